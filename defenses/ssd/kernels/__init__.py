"""SSD's compiled row loops (numba): the projection and the whole fused call.

* :mod:`.projection`: the water-filling projection of one row (Newton's method on
  each level, a sort as the fallback) and its batch loop behind
  :func:`~defenses.ssd.waterfill.water_filling`;
* :mod:`.elementary`: ``log``, ``exp`` and the counter-based uniform stream as
  row loops the compiler turns into SIMD code;
* :mod:`.shield`: the whole :class:`~defenses.ssd.defense.StealthyShield` call,
  one pass per row.

The kernels are compiled as :func:`defenses.jit.compiled` does (nopython, cached on
disk by :class:`defenses.jit.KernelCache`, GIL released, IEEE arithmetic without
``fastmath``), but with numpy's error model: under Python's, every float division
tests its divisor for zero and raises, a branch per element that keeps the compiler
from vectorizing the loop (measured: ``(m - 1) / (m + 1)`` over a row compiled to
scalar ``vdivsd`` under Python's model and to 4-wide ``vdivpd`` under numpy's). A
zero divisor gives inf or NaN instead, which the callers' input checks catch.

A cache entry's stamp covers the files of every helper a kernel inlines (see
:mod:`defenses.jit`), so editing :mod:`.elementary` or :mod:`.projection`
invalidates the kernels built from them. ``python -m defenses.jit`` compiles every
kernel path (both dtypes, both kernels, input hashing) ahead of time
(:mod:`.warmup`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from defenses.jit import vectorizable

Kernel = TypeVar("Kernel", bound=Callable[..., object])


def simd(function: Kernel) -> Kernel:
    """Compile ``function`` (nopython, cached, no GIL, numpy's error model)."""
    return vectorizable(function)


def simd_wide(function: Kernel) -> Kernel:
    """``simd`` with 512-bit vectors where the CPU has them (see ``wide_vectors``)."""
    return vectorizable(function, wide=True)


def simd_inlined(function: Kernel) -> Kernel:
    """Compile a helper of kernels, inlined into each caller (see ``simd``)."""
    return vectorizable(function, inline=True)
