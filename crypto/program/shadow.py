r"""The client's plaintext shadow: an advisory range guard that changes no message.

The encrypted program evaluates polynomials fitted on calibrated ranges; the
client runs the same model in plaintext to see whether its batch stays inside
them. Once a fine-tuning step has been applied, the model's weights are values
the server influenced (without integrity, any function of the client's secrets:
:mod:`crypto.program.bounds`), so a guard that *refused* before upload would turn the
server's choice into a visible event (the next session never sends ``context``):
one exact bit per step. Here the guard is **advisory**:

* every sequence's verdict is computed by the same vectorised pass, whatever the
  values (a full forward pass with a trace, every site compared; no early exit);
* the verdicts are returned to the caller on the client (``Client.flagged``) and
  logged; they never change what is sent, how much, or when;
* bad *input* (shapes, NaN, vocabulary) is still refused before anything is
  sent: those checks read the caller's own arguments, never a weight or a
  decryption.

Site ``s`` of sequence ``b`` is out of range when a value leaves
:math:`[lo_s - \epsilon (hi_s - lo_s), hi_s + \epsilon (hi_s - lo_s)]` or is not
finite, :math:`\epsilon` being the model's guard slack: the same verdict as the
raising guard of :meth:`crypto.models.heformer.HEFormer.forward`, per sequence.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray

if TYPE_CHECKING:
    from ..conversion.model import HEBert
    from ..models.heformer import HEFormer

logger = logging.getLogger(__name__)

BoolArray = npt.NDArray[np.bool_]


def _site_range(model: HEFormer, name: str) -> tuple[float, float]:
    """(lo, hi) of a traced site of :meth:`HEFormer.forward`, by its name."""
    layer = int(name.split()[1]) if name.startswith("layer ") else 0
    if name.endswith("LayerNorm variance s"):
        return model.calibration.layers[layer].ln_lo, 1.0
    if name.endswith("kernel distance u"):
        return 0.0, 1.0
    if name.endswith(("activation input", "pooler input t")):
        return -1.0, 1.0  # mapped into [-1, 1] by their calibrated bounds
    # structural (the model's code, not its values): a new site needs its range
    raise ValueError(f"the advisory guard does not know the range of {name!r}")


def flag_sequences(model: HEFormer, X: npt.ArrayLike) -> BoolArray:
    """Which sequences of ``X`` leave the HEFormer's calibrated ranges (no raise).

    All False when the model runs no polynomial (uncalibrated, or softmax), as
    :func:`crypto.models.train.predict_logits` then guards nothing.
    """
    import torch

    from ..models.heformer import GUARD_SLACK

    arr = np.asarray(X, dtype=np.float64)
    bad = np.zeros(arr.shape[0], dtype=np.bool_)
    if model.config.attention != "gk" or not model.calibration.calibrated:
        return bad
    trace: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        model(torch.as_tensor(arr), poly=True, trace=trace)
    for name, values in trace.items():
        lo, hi = _site_range(model, name)
        tol = GUARD_SLACK * (hi - lo)
        flat = values.detach().numpy().reshape(arr.shape[0], -1)
        with np.errstate(invalid="ignore"):
            outside = (flat < lo - tol) | (flat > hi + tol) | ~np.isfinite(flat)
        bad |= outside.any(axis=1)
    return bad


def flag_ids(
    model: HEBert, ids: npt.ArrayLike, mask: npt.ArrayLike | None
) -> BoolArray:
    """Which sequences leave the converted model's calibrated ranges (no raise)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(model.out_of_range(ids, mask), dtype=np.bool_)


def report(flags: BoolArray, what: str) -> BoolArray:
    """Log the advisory verdict (locally; nothing is sent) and return it."""
    if flags.any():
        logger.warning(
            "%d of %d %s leave the calibrated ranges: their encrypted results may "
            "be wrong (the guard is advisory: the session runs the same way)",
            int(flags.sum()),
            flags.size,
            what,
        )
    return flags


def pack_ids(
    model: HEBert, ids: npt.ArrayLike, mask: npt.ArrayLike | None, slots: int
) -> tuple[list[FloatArray], list[FloatArray], int]:
    """(feature values, key-weight values, batch) of checked ids, no range guard.

    :func:`crypto.program.inputs.pack_inputs` with ``guard=False``: the ids and mask
    are checked (shape, vocabulary), the range verdict is left to
    :func:`flag_ids`.
    """
    from .inputs import pack_inputs

    return pack_inputs(model, ids, mask, slots, guard=False)
