r"""The client's packing of a converted BERT's inputs, its simulation and schedule.

The client embeds token ids with the public embedding (exact LayerNorm, on its
side), and packs them feature-major (:func:`crypto.he.packing.pack`): slot ``b n + i``
holds token ``i`` of sequence ``b``. The batch is *tiled* over every slot (slot
group ``g`` holds sequence ``g mod B``), so no slot carries zeros that the
polynomial LayerNorm would take outside its calibrated range (CKKS mixes all
slots in one ciphertext's coefficients: one wild slot would spoil the others).
The attention mask travels as ``n`` key-weight values
:math:`M_s[bn+i] = m_{b,(i+s) \bmod n}/\sum_j m_{b,j}` (client data, encrypted).

:func:`inference_schedule` derives the public request schedule by running
:func:`crypto.program.encoder.forward` on zeros with a recording key owner, as
:func:`crypto.protocol.schedule.inference_schedule` does for HEFormer: no value changes
which requests the program makes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray

from ..he.evaluator import NumpyBackend
from ..he.packing import pack, roll_tokens
from . import from_bert, simulation
from .encoder import BertWeights, lora_factors

if TYPE_CHECKING:
    from ..conversion.model import HEBert


def tiled(rows: FloatArray, slots: int, n: int) -> FloatArray:
    """``rows`` (batch, n, ...) repeated to fill ``slots // n`` sequence groups."""
    groups = slots // n
    if rows.shape[0] > groups:
        raise ValueError(
            f"{rows.shape[0]} sequences of {n} tokens exceed {slots} slots"
        )
    out: FloatArray = rows[np.arange(groups) % rows.shape[0]]
    return out


def key_weights(mask: FloatArray, slots: int) -> list[FloatArray]:
    r"""The ``n`` rolled key-weight vectors :math:`M_s` of a (batch, n) 0/1 mask."""
    n = mask.shape[1]
    weights = mask / mask.sum(axis=1, keepdims=True)
    flat = tiled(weights, slots, n).reshape(-1)
    out = np.zeros((n, slots))
    out[:, : flat.size] = [roll_tokens(flat, n, s) for s in range(n)]
    return list(out)


def pack_inputs(
    model: HEBert,
    ids: npt.ArrayLike,
    mask: npt.ArrayLike | None,
    slots: int,
    guard: bool = True,
) -> tuple[list[FloatArray], list[FloatArray], int]:
    """(feature values, key-weight values, batch) of checked ids for ``slots``.

    Refuses (``RangeError``) sequences that leave the calibrated ranges, as the
    client does before encrypting; ``guard=False`` checks shapes and vocabulary
    only and leaves the range verdict to the caller (:mod:`crypto.program.shadow`).
    """
    import torch

    if guard:
        model.predict_logits(ids, mask, guard=True)  # shapes, vocabulary, ranges
    ids_t, mask_t = model.check_ids(ids, mask)
    n = model.config.n_tokens
    with torch.no_grad():
        z = np.asarray(model.embed_tokens(ids_t).numpy(), dtype=np.float64)
    m = np.asarray(mask_t.numpy(), dtype=np.float64)
    return pack(tiled(z, slots, n), slots), key_weights(m, slots), ids_t.shape[0]


def simulate(
    model: HEBert,
    ids: npt.ArrayLike,
    mask: npt.ArrayLike | None = None,
    max_level: int = 10**6,
    noise: float = 0.0,
    rng: np.random.Generator | None = None,
) -> tuple[FloatArray, dict[str, int]]:
    """The HE program in float64 (NumpyBackend): (CLS logits, operation counts).

    With ``max_level`` the chain's levels, every refresh the server would ask for
    is counted (``refresh_rounds``); ``noise`` adds CKKS-like Gaussian noise after
    each operation.
    """
    w = BertWeights.from_model(model)
    n = w.n_tokens
    slots = model.check_ids(ids, mask)[0].shape[0] * n
    z, masks, batch = pack_inputs(model, ids, mask, slots)
    return simulation.simulate(
        from_bert(w),
        z,
        lora_factors(model),
        batch,
        max_level,
        NumpyBackend(noise, rng),
        masks=masks,
    )
