"""Shadow models for the offline LiRA attack, built by the user's ``build_model``.

``build_model(seed)`` returns an untrained model of the user's architecture:

* an object with ``fit(X, y)`` (a scikit-learn estimator or pipeline), fitted on the
  shadow's records (features in the model's input shape, labels as the user gave
  them, i.e. decoded through the target's ``classes_``);
* or a ``torch.nn.Module`` (logits out), trained here by mini-batch Adam on
  cross-entropy for :attr:`ShadowConfig.epochs` epochs, seeded by ``seed``.

Shadow ``k`` is trained on a random half of the candidates: each candidate is in
exactly ``S // 2`` of the ``S`` shadows (chosen at random), so it is left out of at
least half of them. Jobs run through :func:`~defenses.parallel.map_jobs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from defenses.arrays import FloatArray, IntArray
from defenses.audit.attacks import ShadowScores
from defenses.audit.target import Outputs, as_audited
from defenses.checks import check_choice, check_int, check_real
from defenses.metrics import true_class_logit
from defenses.parallel import EXECUTORS, Executor, map_jobs
from defenses.threads import single_thread


@dataclass(frozen=True)
class ShadowConfig:
    """How the shadow models are trained.

    Parameters
    ----------
    n_shadows : int
        Number of shadow models S, >= 2 (each candidate is left out of >= S/2).
    executor : {"serial", "process", "ray"}
        Where they train (:func:`~defenses.parallel.map_jobs`).
    n_jobs : int
        Parallel workers for ``"process"`` / ``"ray"``.
    ray_address : str or None
        A running Ray cluster; None starts a local one.
    epochs, batch_size, lr : int, int, float
        Training of a torch-module shadow (ignored for ``fit`` models).
    """

    n_shadows: int = 4
    executor: Executor = "serial"
    n_jobs: int = 1
    ray_address: str | None = None
    epochs: int = 30
    batch_size: int = 64
    lr: float = 1e-3

    def __post_init__(self) -> None:
        check_int("ShadowConfig.n_shadows", self.n_shadows, minimum=2)
        check_choice("ShadowConfig.executor", self.executor, EXECUTORS)
        check_int("ShadowConfig.n_jobs", self.n_jobs, minimum=1)
        check_int("ShadowConfig.epochs", self.epochs, minimum=1)
        check_int("ShadowConfig.batch_size", self.batch_size, minimum=1)
        check_real("ShadowConfig.lr", self.lr, 0.0, 1.0, open_low=True)


@dataclass(frozen=True, eq=False)
class ShadowJob:
    """One shadow: what to build, what to train it on, what to score."""

    build_model: Callable[[int], Any]
    seed: int
    X: FloatArray
    y: IntArray
    queries: FloatArray
    query_labels: IntArray
    input_shape: tuple[int, ...]
    n_classes: int
    classes: npt.NDArray[Any] | None
    outputs: Outputs
    config: ShadowConfig = field(default_factory=ShadowConfig)


def fit_module(
    module: torch.nn.Module,
    X: FloatArray,
    y: IntArray,
    config: ShadowConfig,
    seed: int,
) -> torch.nn.Module:
    """Train ``module`` by mini-batch Adam on cross-entropy (shuffles from ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    param = next(iter(module.parameters()), None)
    if param is None:
        raise TypeError("build_model returned a torch module without parameters")
    inputs = torch.as_tensor(X, dtype=param.dtype)
    labels = torch.as_tensor(y, dtype=torch.int64)
    optimizer = torch.optim.Adam(module.parameters(), lr=config.lr)
    module.train()
    for _ in range(config.epochs):
        order = torch.randperm(inputs.shape[0], generator=generator)
        for start in range(0, inputs.shape[0], config.batch_size):
            batch = order[start : start + config.batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                module(inputs[batch]), labels[batch]
            )
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    module.eval()
    return module


def _columns(probs: FloatArray, model: Any, job: ShadowJob) -> FloatArray:
    """Shadow probabilities in the target's column order (absent classes are 0)."""
    shadow_classes = getattr(model, "classes_", None)
    if shadow_classes is None or probs.shape[1] == job.n_classes:
        return probs
    known = (
        job.classes.tolist() if job.classes is not None else list(range(job.n_classes))
    )
    out = np.zeros((probs.shape[0], job.n_classes))
    for j, value in enumerate(np.asarray(shadow_classes).tolist()):
        out[:, known.index(value)] = probs[:, j]
    return out


def train_shadow(job: ShadowJob) -> FloatArray:
    """Train one shadow and return its logit-scaled confidences on the queries."""
    with single_thread():
        model = job.build_model(job.seed)
        if isinstance(model, torch.nn.Module):
            shaped = job.X.reshape(-1, *job.input_shape)
            fit_module(model, shaped, job.y, job.config, job.seed)
        elif hasattr(model, "fit"):
            labels = job.y if job.classes is None else job.classes[job.y]
            model.fit(job.X.reshape(-1, *job.input_shape), labels)
        else:
            raise TypeError(
                "build_model must return a torch.nn.Module or an object with fit(X, y),"
                f" got {type(model).__name__}"
            )
        audited = as_audited(model, job.input_shape, job.outputs)
        probs = np.asarray(audited.predict(job.queries), dtype=np.float64)
        return true_class_logit(_columns(probs, model, job), job.query_labels)


def inclusion(
    n_shadows: int, n: int, rng: np.random.Generator
) -> npt.NDArray[np.bool_]:
    """(S, n) masks: every candidate in exactly ``S // 2`` shadows, chosen at random."""
    ranks = np.argsort(rng.random((n_shadows, n)), axis=0)
    out: npt.NDArray[np.bool_] = ranks < n_shadows // 2
    return out


def train_shadows(
    build_model: Callable[[int], Any],
    X: FloatArray,
    y: IntArray,
    *,
    input_shape: tuple[int, ...],
    n_classes: int,
    classes: npt.NDArray[Any] | None,
    outputs: Outputs,
    config: ShadowConfig,
    rng: np.random.Generator,
) -> ShadowScores:
    """Train ``config.n_shadows`` shadows on random halves of the candidates ``X``."""
    mask = inclusion(config.n_shadows, X.shape[0], rng)
    seeds = rng.integers(2**31 - 1, size=config.n_shadows)
    jobs = [
        ShadowJob(
            build_model,
            int(seeds[k]),
            X[mask[k]],
            y[mask[k]],
            X,
            y,
            input_shape,
            n_classes,
            classes,
            outputs,
            config,
        )
        for k in range(config.n_shadows)
    ]
    phis = map_jobs(
        train_shadow,
        jobs,
        config.executor,
        config.n_jobs,
        config.ray_address,
        desc="lira shadows",
    )
    return ShadowScores(mask, np.stack(phis))
