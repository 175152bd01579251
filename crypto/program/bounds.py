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

``entry`` and ``norm`` are part of the public agreement, chosen by the client
from its own configuration (never from the server): the fine-tuning job states
them (:attr:`crypto.protocol.jobs.TuningJob.bounds`, for either model
family), the client's ``train``
message states them and so does every message of the server's side of the
session, under the public metadata key :data:`BOUNDS_KEY`
(:meth:`UpdateBounds.statement`, read back by :func:`stated`). The client
refuses, before decrypting it, a server message that states other bounds or
none. The same operations run whatever the values: no branch, no error, only
arithmetic. An honest step (small learning rate) is left unchanged; the counts
of what the bounds changed are returned for the client's own records (never
sent).

The bounds limit how far one step can move the model; they do not make the
updated model's range guard pass. That guard is therefore advisory on the
client's side (:mod:`crypto.program.shadow`): it never changes what the client sends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
            if not _positive_float(value):
                raise ValueError(
                    f"UpdateBounds.{name} must be a finite number > 0, got {value!r}"
                )

    def statement(self) -> dict[str, float]:
        """The bounds as they are stated in a message's public metadata (JSON).

        Floats survive JSON exactly (shortest round-trip representation), so
        :func:`stated` reads back bounds equal to these.
        """
        return {"entry": float(self.entry), "norm": float(self.norm)}


BOUNDS_KEY = "bounds"
"""The public metadata key under which a fine-tuning message states the bounds."""


def stated(meta: Mapping[str, Any]) -> UpdateBounds | None:
    """The bounds a message's public metadata states, or None.

    None when the key is missing or its value is not exactly ``{"entry": e,
    "norm": r}`` with valid bounds (numbers, not booleans, finite, > 0). Reads
    only the metadata, never a ciphertext: a check on it may run before any
    decryption.
    """
    value = meta.get(BOUNDS_KEY)
    if not isinstance(value, dict) or set(value) != {"entry", "norm"}:
        return None
    try:
        return UpdateBounds(value["entry"], value["norm"])
    except ValueError:
        return None


def _positive_float(value: object) -> bool:
    """A number (not a boolean) that is a finite float > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:  # an int beyond float
        return False


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

    An entry the bounds leave alone is returned bit for bit (not recomputed as
    ``old + (returned - old)``); the others are ``old + step``.

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
            kept = step == raw
        changed += int(np.count_nonzero(~kept))
        out[name] = np.where(kept, r, w + step)  # an unbounded entry: as returned
    return out, changed


DEFAULT_BOUNDS = UpdateBounds()
"""The default agreement: an entry may move by 1, a matrix by 4 in norm, per step."""


def _slot(model: Any, name: str) -> tuple[Any, Any]:
    """(tensor to write, merged LoRA product or None) of an arm's matrix ``name``."""
    if name in ("wq", "wk", "wv"):
        layer = getattr(model, name[1])
        return layer.weight, layer.lora_a @ layer.lora_b
    if name[1:] in ("_a", "_b"):
        layer = getattr(model, name[0])
        return (layer.lora_a if name.endswith("a") else layer.lora_b), None
    return getattr(model, "out" if name == "wo" else name), None


def apply_weights(
    model: Any,
    weights: Mapping[str, npt.ArrayLike],
    bounds: UpdateBounds = DEFAULT_BOUNDS,
) -> int:
    r"""Write an HEFormer step's weights (model parametrisation) into ``model``.

    ``weights`` is a :class:`~crypto.program.steps.StepResult`'s (names of
    :attr:`crypto.program.folding.Arm.names`); they are bounded again against the
    model's current matrices (idempotent for a step made from this model), so
    the model moves by at most ``bounds`` and stays finite whatever they hold. A
    merged Q, K or V weight (the ``full`` arm's ``wq``, ...) is written as
    :math:`W - AB`. Returns the entries the bounds changed.
    """
    import torch

    with torch.no_grad():
        old = {}
        for name in weights:
            tensor, merged = _slot(model, name)
            value = tensor if merged is None else tensor + merged
            old[name] = np.asarray(value.detach().numpy(), dtype=np.float64)
        new, changed = bound_update(old, weights, bounds)
        for name, value in new.items():
            tensor, merged = _slot(model, name)
            target = torch.as_tensor(value)
            tensor.copy_(target if merged is None else target - merged)
    return changed
