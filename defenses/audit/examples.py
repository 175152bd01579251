"""The example audits' models and records (the loaders of ``benchmarks/audits``).

* :func:`breast_cancer_mlp`: a scikit-learn pipeline (standardization and a
  one-hidden-layer MLP) fitted on half of the Wisconsin breast-cancer cases; the other
  half are the non-members. Class 0 (malignant) is marked private.
* :func:`digits_cnn`: a small torch CNN (two 3x3 convolutions, a pooling layer and a
  dense head) fitted on half of the 8x8 digits; digit 0 is marked private, and the
  other digits' non-members are the inversion adversary's public data.

Both return :class:`~defenses.audit.inputs.AuditInputs` with a ``build_model`` of the
same architecture for the LiRA shadows. Splits are stratified and seeded.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from defenses.audit.inputs import AuditInputs
from defenses.audit.shadows import ShadowConfig, fit_module
from defenses.checks import check_fraction, check_int
from defenses.data import load_digits, stratified_split
from defenses.threads import single_thread

CNN_FIT = ShadowConfig(epochs=30, batch_size=64, lr=3e-3)
"""How the example CNN is trained (the shadows of its spec use the same)."""


class _QuietMLP(MLPClassifier):  # type: ignore[misc]
    """An MLPClassifier that does not warn when it stops at ``max_iter``."""

    def fit(self, X: Any, y: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            return super().fit(X, y)


def build_mlp(seed: int) -> Pipeline:
    """An untrained standardize-then-MLP(64) pipeline."""
    return make_pipeline(
        StandardScaler(),
        _QuietMLP(hidden_layer_sizes=(64,), max_iter=300, random_state=int(seed)),
    )


def _halves(y: np.ndarray, seed: int, members: float) -> tuple[np.ndarray, np.ndarray]:
    check_int("seed", seed, minimum=0)
    check_fraction("members", members)
    inside, outside = stratified_split(
        y, [members, 1.0 - members], np.random.default_rng(seed)
    )
    return inside, outside


def breast_cancer_mlp(seed: int = 0, members: float = 0.5) -> AuditInputs:
    """A fitted MLP pipeline on breast cancer, its members and non-members."""
    X, y = load_breast_cancer(return_X_y=True)
    inside, outside = _halves(y, seed, members)
    model = build_mlp(seed).fit(X[inside], y[inside])
    return AuditInputs(
        model=model,
        members=(X[inside], y[inside]),
        non_members=(X[outside], y[outside]),
        build_model=build_mlp,
        private_class=0,
    )


class DigitsCNN(torch.nn.Sequential):
    """Conv(1->16) - ReLU - Conv(16->32) - ReLU - MaxPool(2) - Dense(64) - Dense(10)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 4 * 4, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 10),
        )
        generator = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for param in self.parameters():
                fan_in = param[0].numel() if param.ndim > 1 else param.numel()
                bound = 1.0 / float(np.sqrt(fan_in))
                param.uniform_(-bound, bound, generator=generator)


def build_cnn(seed: int) -> DigitsCNN:
    """An untrained :class:`DigitsCNN` initialized from ``seed``."""
    return DigitsCNN(seed)


def digits_cnn(seed: int = 0, members: float = 0.5) -> AuditInputs:
    """A fitted torch CNN on digits (1x8x8 inputs), its members and non-members."""
    data = load_digits()
    X = data.X.reshape(-1, 1, 8, 8)
    inside, outside = _halves(data.y, seed, members)
    with single_thread():
        model = fit_module(build_cnn(seed), X[inside], data.y[inside], CNN_FIT, seed)
    return AuditInputs(
        model=model,
        members=(X[inside], data.y[inside]),
        non_members=(X[outside], data.y[outside]),
        build_model=build_cnn,
        outputs="logits",
        private_class=0,
    )
