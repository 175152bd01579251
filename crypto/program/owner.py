"""The key owner of a fine-tuning step by function calls: keys, chain, round trips.

The function-call steps (:mod:`crypto.program.steps`, :mod:`crypto.program.qkv_step`,
:mod:`crypto.program.head_step`) run the same step programs as the fine-tuning
protocol's server (:func:`crypto.program.sgd.sgd_reply`,
:func:`crypto.program.qkv_step.lora_gradients`); what differs is only who answers
the round trips: here the key owner's functions are called directly
(:class:`Calls`: refresh, roll, unroll, with the same signatures as the protocol's
``Services``), there they are messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray

from ..he.ckks import CKKSParams, TenSEALBackend, local_key_owner
from ..he.evaluator import Backend, Evaluator, NumpyBackend, Value
from ..he.packing import roll_tokens

if TYPE_CHECKING:
    from ..conversion.model import HEBert


@dataclass
class Calls:
    """The key owner's round trips as calls: encrypt, decrypt, refresh, roll, unroll.

    ``n`` tokens per sequence, ``slots`` per ciphertext. A refreshed one-slot sum
    is replicated over the slots.
    """

    encrypt: Callable[[FloatArray], Any]
    decrypt: Callable[[Any], FloatArray]
    n: int
    slots: int

    @classmethod
    def plain(cls, n: int, slots: int) -> Calls:
        """The float64 round trips (the HE simulation: a copy each way)."""
        return cls(
            encrypt=lambda v: np.asarray(v, dtype=np.float64).copy(),
            decrypt=lambda h: np.asarray(h, dtype=np.float64),
            n=n,
            slots=slots,
        )

    def counted(self, ev: Evaluator) -> Calls:
        """The same calls, each encryption and decryption counted on ``ev``."""

        def encrypt(values: FloatArray) -> Any:
            ev.note("encryptions")
            return self.encrypt(values)

        def decrypt(handle: Any) -> FloatArray:
            ev.note("decryptions")
            return self.decrypt(handle)

        return Calls(encrypt, decrypt, self.n, self.slots)

    def refresh(self, values: list[Value]) -> list[Value]:
        """Each value decrypted and encrypted fresh (level 0)."""
        return [Value(self.encrypt(self._full(self.decrypt(v.handle)))) for v in values]

    def _full(self, x: FloatArray) -> FloatArray:
        if x.size == self.slots:
            return x
        return np.full(self.slots, x[0])

    def roll(self, values: list[Value], copies: int) -> list[list[Value]]:
        """``copies`` token rolls of each value, encrypted fresh."""
        plain = [self.decrypt(v.handle) for v in values]
        return [
            [Value(self.encrypt(roll_tokens(p, self.n, s))) for p in plain]
            for s in range(copies)
        ]

    def unroll(self, shifted: list[list[Value]]) -> list[Value]:
        """The rolled-back sum of the shifted groups, encrypted fresh."""
        plain = [[self.decrypt(v.handle) for v in row] for row in shifted]
        total = [
            sum(roll_tokens(plain[s][i], self.n, -s) for s in range(len(plain)))
            for i in range(len(plain[0]))
        ]
        return [Value(self.encrypt(np.asarray(t))) for t in total]

    def values(self, rows: Sequence[FloatArray] | FloatArray) -> list[Value]:
        """Each packed row encrypted."""
        return [Value(self.encrypt(r)) for r in rows]

    def matrix(self, M: npt.ArrayLike) -> list[list[Value]]:
        """A matrix as the client uploads it: each entry replicated, encrypted."""
        return [
            [Value(self.encrypt(np.full(self.slots, float(x)))) for x in row]
            for row in np.asarray(M)
        ]

    def read(self, M: Sequence[Sequence[Value]]) -> FloatArray:
        """A replicated encrypted matrix decrypted (slot 0 of each entry)."""
        return np.array([[self.decrypt(v.handle)[0] for v in row] for row in M])


@dataclass(frozen=True)
class StepOwner:
    """The key owner of a function-call step: arithmetic, chain, slots, keys."""

    backend: Backend
    max_level: int
    slots: int
    encrypt: Callable[[FloatArray], Any]
    decrypt: Callable[[Any], FloatArray]

    @classmethod
    def float64(
        cls,
        model: HEBert,
        ids: npt.ArrayLike,
        mask: npt.ArrayLike | None,
        max_level: int,
    ) -> StepOwner:
        """No encryption: the HE program on NumpyBackend, one slot per token."""
        slots = model.check_ids(ids, mask)[0].shape[0] * model.config.n_tokens

        def same(x: FloatArray) -> FloatArray:
            return np.array(x, dtype=np.float64)

        return cls(NumpyBackend(), max_level, slots, same, same)

    @classmethod
    def ckks(cls, model: HEBert, params: CKKSParams) -> StepOwner:
        """TenSEAL under ``params`` (Galois keys for the slot sums), every slot."""
        encrypt, decrypt = local_key_owner(params, galois=True)
        slots = params.slots - params.slots % model.config.n_tokens
        return cls(TenSEALBackend(), params.levels, slots, encrypt, decrypt)

    def calls(self, n: int) -> tuple[Evaluator, Calls]:
        """The evaluator of a step and the round trips it calls (``n`` tokens)."""
        calls = Calls(self.encrypt, self.decrypt, n, self.slots)
        return Evaluator(self.backend, self.max_level, calls.refresh), calls
