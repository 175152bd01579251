"""The feature-major, rotation-free layout (research note Sec. 5.1).

One packed value per feature; slot ``b * n + i`` holds token ``i`` of sequence
``b``. Attention reads *rolled* copies: copy ``s`` holds token ``(i + s) mod n`` in
slot ``i``. Encrypted scalars (LoRA factors, trained weights) are replicated over
the slots, one value per matrix entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from defenses.arrays import FloatArray

from .evaluator import Value


def unit(handle_of: Callable[[float], Any], M: FloatArray) -> list[list[Value]]:
    """Wrap a matrix of encrypted (or simulated) scalars, one value per entry."""
    return [[Value(handle_of(float(x))) for x in row] for row in M]


def pack(z: FloatArray, slots: int) -> list[FloatArray]:
    """Feature-major packing of embeddings (batch, n, d) into d arrays of ``slots``.

    Slot ``b * n + i`` holds token ``i`` of sequence ``b``; unused slots are zero.
    """
    b, n, d = z.shape
    if b * n > slots:
        raise ValueError(f"{b} sequences of {n} tokens do not fit in {slots} slots")
    out = np.zeros((d, slots))
    out[:, : b * n] = z.reshape(b * n, d).T
    return list(out)


def roll_tokens(values: FloatArray, n: int, shift: int) -> FloatArray:
    """Copy ``shift``: slot ``b n + i`` gets slot ``b n + (i + shift) mod n``."""
    if values.size % n:
        raise ValueError(f"{values.size} slots are not a multiple of {n} tokens")
    return np.roll(values.reshape(-1, n), -shift, axis=1).reshape(-1)
