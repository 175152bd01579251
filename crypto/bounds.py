r"""Public bounds on a fine-tuning update, applied before the client uses it.

Without integrity a malicious server can return, as the update of an encrypted
fine-tuning step, an encryption of any function of the client's secrets (labels
are one-hot slots: a product with a public mask and a slot sum give
:math:`[y_b = k]`). Whatever the client then does with the update is a channel
unless it is independent of the value. So every returned update goes through one
function, :func:`bound_update`, before it is applied:

1. the step :math:`D = W_{\text{returned}} - W_{\text{old}}` of each matrix is
   sanitised by a public rule: a non-finite entry becomes 0;
2. each entry is clipped to :math:`[-e, e]` (``entry``);
3. each matrix's step is scaled into the Frobenius ball of radius ``norm``:
   :math:`D \leftarrow D \min(1, \rho / \lVert D\rVert_F)`;
4. :math:`W_{\text{new}} = W_{\text{old}} + D`.

``entry`` and ``norm`` are part of the public agreement (the fine-tuning job
states them), chosen by the client. The same operations run whatever the
values: no branch, no error, only arithmetic. An honest step (small learning
rate) is left unchanged; the counts of what the bounds changed are returned for
the client's own records (never sent).

The bounds limit how far one step can move the model; they do not make the
updated model's range guard pass. That guard is therefore advisory on the
client's side (:mod:`crypto.shadow`): it never changes what the client sends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray


@dataclass(frozen=True)
class UpdateBounds:
    """Public bounds on one fine-tuning step's change of each trained matrix.

    Parameters
    ----------
    entry : float
        Largest absolute change of one entry, > 0.
    norm : float
        Largest Frobenius norm of one matrix's change, > 0.
    """

    entry: float = 1.0
    norm: float = 4.0

    def __post_init__(self) -> None:
        for name in ("entry", "norm"):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"UpdateBounds.{name} must be a finite number > 0, got {value!r}"
                )


def sanitise(values: npt.ArrayLike) -> FloatArray:
    """``values`` as float64 with every NaN or infinity replaced by 0 (public rule)."""
    v = np.asarray(values, dtype=np.float64)
    out: FloatArray = np.where(np.isfinite(v), v, 0.0)
    return out


def bound_step(step: npt.ArrayLike, bounds: UpdateBounds) -> FloatArray:
    r"""One matrix's step, sanitised, clipped per entry, then into the norm ball."""
    with np.errstate(over="ignore", invalid="ignore"):
        d = np.clip(sanitise(step), -bounds.entry, bounds.entry)
        size = float(np.sqrt(np.sum(d * d)))
    scale = min(1.0, bounds.norm / max(size, 1e-300))
    out: FloatArray = d * scale
    return out


def bound_update(
    old: Mapping[str, npt.ArrayLike],
    returned: Mapping[str, npt.ArrayLike],
    bounds: UpdateBounds,
) -> tuple[dict[str, FloatArray], int]:
    r"""``old + bound_step(returned - old)`` for each matrix, and the entries changed.

    ``old`` holds the client's own matrices before the step (finite); ``returned``
    the server-shaped ones (any float, NaN or infinity included), with the same
    names and shapes.

    Raises
    ------
    ValueError
        If the names or shapes differ (public: they are the agreement's) or
        ``old`` is not finite (the client's own state).
    """
    if set(old) != set(returned):
        raise ValueError(
            f"returned update: names {sorted(returned)} are not {sorted(old)}"
        )
    out: dict[str, FloatArray] = {}
    changed = 0
    for name, before in old.items():
        w = np.asarray(before, dtype=np.float64)
        r = np.asarray(returned[name], dtype=np.float64)
        if r.shape != w.shape:
            raise ValueError(
                f"returned update {name!r}: shape {r.shape}, not {w.shape}"
            )
        if not np.all(np.isfinite(w)):
            raise ValueError(f"{name!r}: the weights before the step are not finite")
        with np.errstate(over="ignore", invalid="ignore"):
            raw = r - w
        step = bound_step(raw, bounds)
        with np.errstate(invalid="ignore"):
            changed += int(np.count_nonzero(step != raw))
        out[name] = w + step
    return out, changed


DEFAULT_BOUNDS = UpdateBounds()
"""The default agreement: an entry may move by 1, a matrix by 4 in norm, per step."""
