r"""Input-hash seeding of SSD's pseudo-labels (the paper's Appendix H).

A query's pseudo-label is drawn with a uniform number that is a keyed hash of the
query, :math:`u = \mathrm{BLAKE2b}_\kappa(\text{row bytes}) / 2^{64}`, so repeating
a query returns the same answer and voting over repeats gains nothing. With a
``resolution`` :math:`r` the row is first rounded to the grid,
:math:`\operatorname{round}(x / r)`, so that tiny perturbations of a query share its
answer (a coarse stand-in for locality-sensitive hashing).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

FloatArray = npt.NDArray[np.float64]


def input_keys(inputs: Any, n: int, resolution: float | None) -> list[bytes]:
    """One byte string per row of ``inputs`` (rounded to ``resolution`` if given)."""
    if isinstance(inputs, torch.Tensor):
        inputs = inputs.detach().cpu().numpy()
    rows = np.ascontiguousarray(np.asarray(inputs, dtype=np.float64).reshape(n, -1))
    if resolution is not None:
        rows = np.ascontiguousarray(np.round(rows / resolution).astype(np.int64))
    return [row.tobytes() for row in rows]


def hash_uniforms(keys: list[bytes], key: bytes) -> FloatArray:
    """Uniforms in [0, 1]: each row's keyed 64-bit BLAKE2b hash over 2^64."""
    words = [
        int.from_bytes(hashlib.blake2b(k, key=key, digest_size=8).digest(), "little")
        for k in keys
    ]
    return np.asarray(words, dtype=np.float64) / 2.0**64
