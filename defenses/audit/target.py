r"""The user's fitted classifier as the audit sees it: flat rows in, probabilities out.

Three kinds of model are accepted, as :meth:`~defenses.ssd.StealthyShield.wrap` does:

* a ``torch.nn.Module``: what it returns is read from its last layer as SSD's
  wrapper reads it (``nn.Softmax``: probabilities, ``nn.LogSoftmax``:
  log-probabilities, else logits, whose :math:`\operatorname{softmax}` is taken in
  float64; rows that are already probabilities are taken as they are) or given as
  ``outputs=``;
* an object with ``predict_proba`` (a scikit-learn classifier or pipeline); the
  columns follow its ``classes_``;
* any callable returning probabilities (or logits with ``outputs="logits"``).

The attacks work on flat rows of shape ``(n, d)``; :class:`AuditedModel` reshapes
them to the model's input shape (e.g. ``(n, 1, 8, 8)`` for a CNN) before each call
and checks every answer: shape ``(n, K)``, finite, and on the probability simplex
within :data:`SIMPLEX_TOLERANCE`. The answers are measured as they are: a row within
the tolerance is passed on unchanged (never clipped or re-divided by its sum, which
would move entries by a rounding step and break the exact ties the tie-safe ROC
counts), and a row beyond it is refused, naming the model.
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
"""How far below 0 an entry, and (times K) a row's sum from 1, may be (float32)."""


def _softmax(logits: FloatArray) -> FloatArray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    out: FloatArray = e / e.sum(axis=1, keepdims=True)
    return out


def _torch_predict(
    module: torch.nn.Module, shape: tuple[int, ...], outputs: Outputs, batch: int
) -> Callable[[FloatArray], FloatArray]:
    from defenses.ssd.torch import module_outputs, to_probs

    param = next(iter(module.parameters()), None)
    dtype = torch.float32 if param is None else param.dtype
    device = torch.device("cpu") if param is None else param.device
    kind = module_outputs(module) if outputs == "auto" else outputs
    # "auto" on a logits ending still takes rows that are already probabilities
    convert = "auto" if outputs == "auto" and kind == "logits" else kind

    def predict(X: FloatArray) -> FloatArray:
        module.eval()
        parts = []
        with torch.inference_mode():
            for start in range(0, X.shape[0], batch):
                rows = X[start : start + batch].reshape(-1, *shape)
                out = module(torch.as_tensor(rows, dtype=dtype, device=device))
                if not torch.isfinite(out).all():
                    raise ValueError(
                        f"model ({type(module).__name__}) answered NaN or inf: "
                        "check its parameters, buffers and inputs"
                    )
                parts.append(to_probs(out.to("cpu"), convert).numpy())
        return np.concatenate(parts)

    return predict


def _reshaping(
    call: Callable[[Any], Any], shape: tuple[int, ...], logits: bool
) -> Callable[[FloatArray], FloatArray]:
    def predict(X: FloatArray) -> FloatArray:
        values = np.asarray(call(X.reshape(-1, *shape)), dtype=np.float64)
        return _softmax(values) if logits else values

    return predict


def check_answers(
    values: FloatArray, n: int, n_classes: int | None, name: str = "model"
) -> None:
    """Raise ValueError naming the model unless ``values`` are n probability rows.

    A row is on the simplex when no entry is below ``-SIMPLEX_TOLERANCE`` and its
    sum is within ``K * SIMPLEX_TOLERANCE`` of 1.
    """
    if values.ndim != 2 or values.shape[0] != n or values.shape[1] < 2:
        raise ValueError(
            f"{name} must answer an (n, K >= 2) array of probabilities for {n} rows, "
            f"got shape {values.shape}"
        )
    if n_classes is not None and values.shape[1] != n_classes:
        raise ValueError(
            f"{name} answered {values.shape[1]} columns, expected {n_classes}"
        )
    finite = np.isfinite(values).all(axis=1)
    if not finite.all():
        rows = np.flatnonzero(~finite)[:5].tolist()
        raise ValueError(f"{name} answered NaN or inf (rows {rows})")
    off = np.abs(values.sum(axis=1) - 1.0)
    low = values.min(axis=1)
    bad = (off > SIMPLEX_TOLERANCE * values.shape[1]) | (low < -SIMPLEX_TOLERANCE)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name}'s answers are not probabilities: row {row} sums to "
            f"{values[row].sum():.6g} with smallest entry {low[row]:.3g} (rows must "
            f"be >= {-SIMPLEX_TOLERANCE:g} and sum to 1 within "
            f"{SIMPLEX_TOLERANCE * values.shape[1]:.1e}; {int(bad.sum())} of {n} "
            "are not); the audit measures answers as they are and does not "
            "renormalise them: pass outputs='logits' if the model returns logits"
        )


def check_finite_state(module: torch.nn.Module, name: str) -> None:
    """Raise ValueError naming the first parameter or buffer holding NaN or inf."""
    for kind, items in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for key, tensor in items:
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(
                    f"{name} has NaN or inf in its {kind} {key!r}: a broken model "
                    "is refused, not audited"
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
    name : str
        How messages name the model (``model (RandomForestClassifier)``).
    """

    predict: Callable[[FloatArray], FloatArray]
    input_shape: tuple[int, ...]
    classes: npt.NDArray[Any] | None = None
    name: str = "model"

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
        values: FloatArray = np.asarray(self.predict(rows), dtype=np.float64)
        check_answers(values, rows.shape[0], None, self.name)
        return values

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
        What the model returns; "auto" reads a torch module's last layer (logits
        unless it is ``nn.Softmax`` / ``nn.LogSoftmax``, and rows that are already
        probabilities are taken as they are) and is probabilities otherwise.
    batch_size : int
        Rows per forward pass of a torch module.
    """
    check_choice("outputs", outputs, OUTPUTS)
    check_int("batch_size", batch_size, minimum=1)
    shape = tuple(int(s) for s in input_shape)
    name = f"model ({type(model).__name__})"
    if isinstance(model, torch.nn.Module):
        check_finite_state(model, name)
        predict = _torch_predict(model, shape, outputs, batch_size)
        return AuditedModel(predict, shape, name=name)
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
            name,
        )
    if callable(model):
        name = f"model ({getattr(model, '__qualname__', type(model).__name__)})"
        return AuditedModel(
            _reshaping(model, shape, outputs == "logits"), shape, name=name
        )
    raise TypeError(
        "model must be a torch.nn.Module, have predict_proba, or be callable; "
        f"got {type(model).__name__}"
    )
