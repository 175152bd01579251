r"""Level-tracking slot-wise arithmetic, for any backend.

A :class:`Backend` does slot-wise arithmetic on opaque handles: float64 arrays
(:class:`NumpyBackend`, the HE simulation: exact arithmetic, optionally CKKS-like
Gaussian noise after each operation) or ciphertexts (the TenSEAL backend of
:mod:`crypto.he.ckks`). :class:`Evaluator` tracks each value's multiplicative level;
before a stage that would exceed the modulus chain it asks the key owner for a
*refresh* (decrypt and re-encrypt, the client-aided stand-in for bootstrapping) and
counts it, or raises :class:`DepthError` when running non-interactively.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from defenses.arrays import FloatArray
from defenses.checks import check_int, check_real


class DepthError(RuntimeError):
    """The computation needs more levels than the CKKS parameters provide."""


class Backend(Protocol):
    """Slot-wise arithmetic on opaque handles (plaintext arrays or ciphertexts)."""

    def add(self, a: Any, b: Any) -> Any:
        """A + b."""
        ...

    def sub(self, a: Any, b: Any) -> Any:
        """A - b."""
        ...

    def mul(self, a: Any, b: Any) -> Any:
        """A * b (both operands values: a ciphertext-ciphertext product)."""
        ...

    def square(self, a: Any) -> Any:
        """A * a."""
        ...

    def mul_scalar(self, a: Any, c: float) -> Any:
        """A * c for a public scalar c."""
        ...

    def add_scalar(self, a: Any, c: float) -> Any:
        """A + c for a public scalar c."""
        ...

    def polyval(self, a: Any, coefficients: Sequence[float]) -> Any:
        """Polynomial with low-to-high coefficients evaluated at a."""
        ...

    def neg(self, a: Any) -> Any:
        """-a."""
        ...

    def mul_plain(self, a: Any, mask: FloatArray) -> Any:
        """A * m for a public vector m (slot-wise, one level)."""
        ...

    def sum_slots(self, a: Any) -> Any:
        """The sum of a's slots, replicated over them (rotations, no level)."""
        ...


@dataclass
class NumpyBackend:
    """Plaintext arithmetic on float64 arrays; the HE simulation when ``noise > 0``.

    ``noise`` is the standard deviation of Gaussian noise added after every
    operation (a CKKS-like rounding and encryption error).
    """

    noise: float = 0.0
    rng: np.random.Generator | None = None

    def __post_init__(self) -> None:
        check_real("NumpyBackend.noise", self.noise, 0.0)
        if self.noise and self.rng is None:
            raise ValueError("NumpyBackend with noise > 0 needs an rng")

    def _n(self, x: FloatArray) -> FloatArray:
        if self.noise and self.rng is not None:
            return x + self.noise * self.rng.standard_normal(x.shape)
        return x

    def add(self, a: FloatArray, b: FloatArray) -> FloatArray:
        """A + b."""
        return a + b

    def sub(self, a: FloatArray, b: FloatArray) -> FloatArray:
        """A - b."""
        return a - b

    def mul(self, a: FloatArray, b: FloatArray) -> FloatArray:
        """A * b."""
        return self._n(a * b)

    def square(self, a: FloatArray) -> FloatArray:
        """A * a."""
        return self._n(a * a)

    def mul_scalar(self, a: FloatArray, c: float) -> FloatArray:
        """A * c."""
        return self._n(a * c)

    def add_scalar(self, a: FloatArray, c: float) -> FloatArray:
        """A + c."""
        return a + c

    def neg(self, a: FloatArray) -> FloatArray:
        """-a."""
        return -a

    def mul_plain(self, a: FloatArray, mask: FloatArray) -> FloatArray:
        """A * mask."""
        return self._n(a * mask)

    def sum_slots(self, a: FloatArray) -> FloatArray:
        """Sum of the slots, replicated."""
        return self._n(np.full_like(a, a.sum()))

    def polyval(self, a: FloatArray, coefficients: Sequence[float]) -> FloatArray:
        """Horner evaluation."""
        out = np.zeros_like(a)
        for c in list(coefficients)[::-1]:
            out = out * a + c
        return self._n(out)


@dataclass
class Value:
    """A packed value (array or ciphertext) and the levels it has consumed.

    ``one_slot`` marks a slot sum and what is computed from slot sums alone:
    TenSEAL's slot sum leaves a one-slot vector, and an operation that meets a
    full vector first replicates it (rotations and a mask that the product
    counters do not see), counted as ``replications``.
    """

    handle: Any
    level: int = 0
    one_slot: bool = False


Refresh = Callable[[list[Value]], list[Value]]
Roll = Callable[[list[Value], int], list[list[Value]]]


@dataclass
class Evaluator:
    """Level-tracking arithmetic on :class:`Value` s.

    Parameters
    ----------
    backend : Backend
        The arithmetic.
    max_level : int
        Multiplications the modulus chain allows before a refresh.
    refresh : callable or None
        Client-aided refresh (decrypt and re-encrypt at level 0); None means
        non-interactive (running out of levels raises :class:`DepthError`).
    """

    backend: Backend
    max_level: int
    refresh: Refresh | None = None
    counts: dict[str, int] = field(default_factory=dict)
    stage: str = field(default="", init=False)
    """The stage whose refresh is being requested (read by a recording refresh)."""

    def __post_init__(self) -> None:
        check_int("Evaluator.max_level", self.max_level, 1)

    def note(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to the operation counter ``name``."""
        self.counts[name] = self.counts.get(name, 0) + amount

    def ensure(self, values: list[Value], need: int, stage: str) -> list[Value]:
        """Refresh ``values`` if ``need`` more levels would exceed the chain."""
        if need > self.max_level:
            raise DepthError(
                f"stage {stage!r} needs {need} levels in one go; the parameters give "
                f"{self.max_level}"
            )
        top = max(v.level for v in values)
        if top + need <= self.max_level:
            return values
        if self.refresh is None:
            raise DepthError(
                f"stage {stage!r} needs levels {top}+{need} > {self.max_level} and the "
                "configuration is non-interactive; use a larger ring or allow refreshes"
            )
        self.note("refresh_rounds")
        self.note("refreshed_values", len(values))
        self.stage = stage
        return self.refresh(values)

    def _both(self, a: Value, b: Value) -> bool:
        """Whether ``a (op) b`` is one-slot.

        A one-slot operand meeting a full one is replicated first (counted).
        """
        if a.one_slot != b.one_slot:
            self.note("replications")
        return a.one_slot and b.one_slot

    def add(self, a: Value, b: Value) -> Value:
        """A + b."""
        one = self._both(a, b)
        return Value(self.backend.add(a.handle, b.handle), max(a.level, b.level), one)

    def sub(self, a: Value, b: Value) -> Value:
        """A - b."""
        one = self._both(a, b)
        return Value(self.backend.sub(a.handle, b.handle), max(a.level, b.level), one)

    def mul(self, a: Value, b: Value) -> Value:
        """A * b (ciphertext-ciphertext)."""
        self.note("ct_ct_mul")
        one = self._both(a, b)
        level = max(a.level, b.level) + 1
        return Value(self.backend.mul(a.handle, b.handle), level, one)

    def square(self, a: Value) -> Value:
        """A * a."""
        self.note("ct_ct_mul")
        return Value(self.backend.square(a.handle), a.level + 1, a.one_slot)

    def scale(self, a: Value, c: float) -> Value:
        """A * c."""
        self.note("ct_pt_mul")
        out = self.backend.mul_scalar(a.handle, float(c))
        return Value(out, a.level + 1, a.one_slot)

    def neg(self, a: Value) -> Value:
        """-a (no level)."""
        return Value(self.backend.neg(a.handle), a.level, a.one_slot)

    def mask(self, a: Value, m: FloatArray) -> Value:
        """A * m for a public vector m (one level; a one-slot ``a`` is replicated)."""
        self.note("ct_pt_mul")
        if a.one_slot:
            self.note("replications")
        return Value(self.backend.mul_plain(a.handle, m), a.level + 1)

    def slot_sum(self, a: Value) -> Value:
        """Sum over the slots, replicated (rotations with Galois keys; no level)."""
        self.note("slot_sums")
        return Value(self.backend.sum_slots(a.handle), a.level, True)

    def shift(self, a: Value, c: float) -> Value:
        """A + c."""
        out = self.backend.add_scalar(a.handle, float(c))
        return Value(out, a.level, a.one_slot)

    def poly(self, a: Value, coefficients: Sequence[float] | FloatArray) -> Value:
        r"""p(a); consumes :math:`\\lceil\\log_2(\\deg+1)\\rceil` levels."""
        self.note("polyval")
        degree = len(coefficients) - 1
        return Value(
            self.backend.polyval(a.handle, [float(c) for c in coefficients]),
            a.level + math.ceil(math.log2(degree + 1)),
            a.one_slot,
        )

    def total(self, values: Sequence[Value]) -> Value:
        """Sum of values."""
        out = values[0]
        for v in values[1:]:
            out = self.add(out, v)
        return out

    def linear(self, xs: Sequence[Value], W: FloatArray) -> list[Value]:
        r""":math:`y_f = \\sum_g x_g W_{gf}` with public W (zero entries skipped)."""
        if W.shape[0] != len(xs):
            raise ValueError(
                f"linear: {len(xs)} inputs for a weight of shape {W.shape}"
            )
        out = []
        for f in range(W.shape[1]):
            terms = [
                self.scale(xs[g], W[g, f]) for g in range(W.shape[0]) if W[g, f] != 0
            ]
            if not terms:
                raise ValueError(f"linear: output {f} has an all-zero weight column")
            out.append(self.total(terms))
        return out

    def lora(
        self,
        xs: Sequence[Value],
        W: FloatArray,
        A: Sequence[Sequence[Value]],
        B: Sequence[Sequence[Value]],
    ) -> list[Value]:
        """:math:`x W_0 + (x A) B` with public W and encrypted A (d x r), B (r x d)."""
        base = self.linear(xs, W)
        low = [
            self.total([self.mul(xs[g], A[g][r]) for g in range(len(xs))])
            for r in range(len(B))
        ]
        return [
            self.add(
                base[f], self.total([self.mul(low[r], B[r][f]) for r in range(len(B))])
            )
            for f in range(W.shape[1])
        ]
