"""Compiled kernels: numba's ``njit``, typed for the callers.

A kernel is written as a plain, typed Python function over numpy arrays and compiled
on first call (nopython mode, IEEE arithmetic: no ``fastmath``, so the order of every
sum is the one written). The machine code is cached on disk next to the module, so
later processes load it instead of compiling again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import numba

Kernel = TypeVar("Kernel", bound=Callable[..., object])


def compiled(function: Kernel) -> Kernel:
    """Compile ``function`` with numba (nopython, cached, releasing the GIL)."""
    return cast(Kernel, numba.njit(cache=True, nogil=True)(function))


def inlined(function: Kernel) -> Kernel:
    """Compile a helper of kernels, inlined into each caller.

    A call between compiled functions passes every array as a reference-counted
    structure; for small helpers called per element that bookkeeping costs more
    than their arithmetic.
    """
    return cast(Kernel, numba.njit(cache=True, nogil=True, inline="always")(function))
