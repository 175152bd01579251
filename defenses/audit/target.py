r"""The user's fitted classifier as the audit sees it: flat rows in, probabilities out.

Three kinds of model are accepted, as :meth:`~defenses.ssd.StealthyShield.wrap` does:

* a ``torch.nn.Module`` (its outputs are logits unless ``outputs="probs"``; the
  probabilities are :math:`\operatorname{softmax}` of the logits in float64);
* an object with ``predict_proba`` (a scikit-learn classifier or pipeline); the
  columns follow its ``classes_``;
* any callable returning probabilities (or logits with ``outputs="logits"``).

The attacks work on flat rows of shape ``(n, d)``; :class:`AuditedModel` reshapes
them to the model's input shape (e.g. ``(n, 1, 8, 8)`` for a CNN) before each call
and checks every answer: shape ``(n, K)``, finite, and on the probability simplex.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from defenses.arrays import FloatArray
from defenses.checks import check_choice, check_int

Outputs = Literal["auto", "probs", "logits"]
OUTPUTS: tuple[Outputs, ...] = ("auto", "probs", "logits")

SIMPLEX_TOLERANCE = 1e-4
"""How far a row of probabilities may sum from 1 (float32 models round)."""


def _softmax(logits: FloatArray) -> FloatArray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    out: FloatArray = e / e.sum(axis=1, keepdims=True)
    return out


def _torch_predict(
    module: torch.nn.Module, shape: tuple[int, ...], logits: bool, batch: int
) -> Callable[[FloatArray], FloatArray]:
    param = next(iter(module.parameters()), None)
    dtype = torch.float32 if param is None else param.dtype
    device = torch.device("cpu") if param is None else param.device

    def predict(X: FloatArray) -> FloatArray:
        module.eval()
        parts = []
        with torch.inference_mode():
            for start in range(0, X.shape[0], batch):
                rows = X[start : start + batch].reshape(-1, *shape)
                out = module(torch.as_tensor(rows, dtype=dtype, device=device))
                parts.append(out.detach().to("cpu", torch.float64).numpy())
        values = np.concatenate(parts)
        return _softmax(values) if logits else values

    return predict


def _reshaping(
    call: Callable[[Any], Any], shape: tuple[int, ...], logits: bool
) -> Callable[[FloatArray], FloatArray]:
    def predict(X: FloatArray) -> FloatArray:
        values = np.asarray(call(X.reshape(-1, *shape)), dtype=np.float64)
        return _softmax(values) if logits else values

    return predict


def check_answers(values: FloatArray, n: int, n_classes: int | None) -> None:
    """Raise ValueError naming ``model`` unless ``values`` are n probability rows."""
    if values.ndim != 2 or values.shape[0] != n or values.shape[1] < 2:
        raise ValueError(
            f"model must answer an (n, K >= 2) array of probabilities for {n} rows, "
            f"got shape {values.shape}"
        )
    if n_classes is not None and values.shape[1] != n_classes:
        raise ValueError(
            f"model answered {values.shape[1]} columns, expected {n_classes}"
        )
    if not np.all(np.isfinite(values)):
        raise ValueError("model answered NaN or inf")
    if values.min() < -SIMPLEX_TOLERANCE or not np.allclose(
        values.sum(axis=1), 1.0, atol=SIMPLEX_TOLERANCE * values.shape[1]
    ):
        raise ValueError(
            "model's answers are not probabilities (rows must be >= 0 and sum to 1); "
            "pass outputs='logits' if it returns logits"
        )


@dataclass(frozen=True, eq=False)
class AuditedModel:
    """A fitted classifier behind a checked ``predict_proba`` on flat rows.

    Attributes
    ----------
    predict : callable
        Maps flat rows ``(n, d)`` to probabilities ``(n, K)``.
    input_shape : tuple of int
        The shape of one record as the model takes it (``(d,)`` for tabular data).
    classes : ndarray or None
        The model's ``classes_`` (column order), when it has them.
    """

    predict: Callable[[FloatArray], FloatArray]
    input_shape: tuple[int, ...]
    classes: npt.NDArray[Any] | None = None

    @property
    def n_features(self) -> int:
        """Length d of a flat record."""
        return math.prod(self.input_shape)

    def predict_proba(self, X: npt.ArrayLike) -> FloatArray:
        """Checked probabilities of the flat rows ``X`` (n, d)."""
        rows = np.asarray(X, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] != self.n_features:
            raise ValueError(
                f"X must have shape (n, {self.n_features}), got {rows.shape}"
            )
        values = np.asarray(self.predict(rows), dtype=np.float64)
        check_answers(values, rows.shape[0], None)
        clipped = np.clip(values, 0.0, None)
        out: FloatArray = clipped / clipped.sum(axis=1, keepdims=True)
        return out

    def clean_proba(self, X: npt.ArrayLike) -> FloatArray:
        """The same as :meth:`predict_proba` (the undefended answers)."""
        return self.predict_proba(X)


def as_audited(
    model: Any,
    input_shape: tuple[int, ...],
    outputs: Outputs = "auto",
    batch_size: int = 4096,
) -> AuditedModel:
    """Wrap ``model`` (torch module, ``predict_proba`` object or callable).

    Parameters
    ----------
    model : torch.nn.Module, object with ``predict_proba``, or callable
        The fitted classifier.
    input_shape : tuple of int
        Shape of one record as the model takes it.
    outputs : {"auto", "probs", "logits"}
        What the model returns; "auto" is logits for a torch module and
        probabilities otherwise.
    batch_size : int
        Rows per forward pass of a torch module.
    """
    check_choice("outputs", outputs, OUTPUTS)
    check_int("batch_size", batch_size, minimum=1)
    shape = tuple(int(s) for s in input_shape)
    if isinstance(model, torch.nn.Module):
        predict = _torch_predict(model, shape, outputs != "probs", batch_size)
        return AuditedModel(predict, shape)
    if hasattr(model, "predict_proba"):
        if outputs == "logits":
            raise ValueError(
                "outputs='logits' does not fit a model with predict_proba "
                "(it returns probabilities)"
            )
        classes = getattr(model, "classes_", None)
        return AuditedModel(
            _reshaping(model.predict_proba, shape, False),
            shape,
            None if classes is None else np.asarray(classes),
        )
    if callable(model):
        return AuditedModel(_reshaping(model, shape, outputs == "logits"), shape)
    raise TypeError(
        "model must be a torch.nn.Module, have predict_proba, or be callable; "
        f"got {type(model).__name__}"
    )
