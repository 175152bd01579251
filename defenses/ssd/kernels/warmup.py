"""Compile every SSD kernel path ahead of time (run by ``python -m defenses.jit``).

A call compiles the kernels its argument types need (see :mod:`defenses.jit`): the
row kernel (K > 16) or the row-batched one (K <= 16, which also runs the row kernel
on its last rows), each for float32 and float64 answers; the keyed BLAKE2b of
input-hash seeding; the projection behind :func:`~defenses.ssd.waterfill.water_filling`.
:func:`run` makes one small call of each, so that every later process loads them
from the cache. The arrays the kernels receive are read-only views (see
:func:`defenses.ssd.batch.frozen`), so a caller's array, writable or not, needs no
other compilation.
"""

from __future__ import annotations

import numpy as np

from defenses.ssd.kernels.small import SMALL_K


def run() -> None:
    """One call of each kernel path, for float32 and float64 rows."""
    from defenses.ssd.defense import StealthyShield
    from defenses.ssd.waterfill import water_filling

    rng = np.random.default_rng(0)
    for k in (3, SMALL_K + 1):
        val = rng.dirichlet(np.ones(k), size=2 * k)
        labels = np.arange(2 * k) % k
        for seeding in ("random", "input-hash"):
            shield = StealthyShield(seed=0, seeding=seeding, n_threads=1)
            shield.fit(val, labels)
            for dtype in (np.float64, np.float32):
                rows = val.astype(dtype)
                shield(rows)
                shield.pseudo_labels(rows)
        water_filling(val, val[::-1], np.full(2 * k, 0.5))
