"""The HE simulation of a program: float64 values, a key owner that answers in kind.

The simulated key owner refreshes and rolls as the real one does (a fresh value at
level 0; the rolled copies of :func:`crypto.he.packing.roll_tokens`), adding the
backend's CKKS-like noise to every value it answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, NumpyBackend, Value
from ..he.packing import roll_tokens, unit
from .forward import Run, forward
from .spec import Program


@dataclass
class SimulatedOwner:
    """The key owner in float64: refresh and roll, with the backend's noise."""

    backend: NumpyBackend
    n_tokens: int

    def refresh(self, values: list[Value]) -> list[Value]:
        """Each value again at level 0 (decrypted and re-encrypted)."""
        return [Value(self.backend._n(np.asarray(v.handle))) for v in values]

    def roll(self, values: list[Value], count: int) -> list[list[Value]]:
        """``count`` rolled fresh copies of ``values`` (copy ``s`` rolled by ``s``)."""
        n = self.n_tokens
        return [
            [
                Value(self.backend._n(roll_tokens(np.asarray(v.handle), n, s)))
                for v in values
            ]
            for s in range(count)
        ]


def simulate(
    p: Program,
    z: list[FloatArray],
    factors: dict[str, FloatArray],
    batch: int,
    max_level: int,
    backend: NumpyBackend,
    interactive: bool = True,
    masks: list[FloatArray] | None = None,
) -> tuple[FloatArray, dict[str, int]]:
    """(CLS logits (batch, classes), operation counts) of ``p`` on packed ``z``.

    ``factors`` are the client's secret matrices (one simulated value per entry);
    non-interactive runs give the program the rolled copies of ``z`` instead of a
    key owner (a chain too short raises :class:`~crypto.he.evaluator.DepthError`).
    """
    n = p.n_tokens
    owner = SimulatedOwner(backend, n)
    ev = Evaluator(backend, max_level, owner.refresh if interactive else None)
    lora = {name: unit(lambda x: x, M) for name, M in factors.items()}
    packed = [Value(v) for v in z]
    key_weights = None if masks is None else [Value(m) for m in masks]
    if interactive:
        run = Run(ev, lora, owner.roll, masks=key_weights)
    else:
        rolled = [
            [Value(roll_tokens(v.handle, n, s)) for v in packed] for s in range(n)
        ]
        run = Run(ev, lora, rolled_z=rolled, masks=key_weights)
    logits = forward(run, p, packed)
    cls = np.stack([np.asarray(v.handle)[: batch * n : n] for v in logits], axis=1)
    return cls, dict(ev.counts)
