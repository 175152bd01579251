"""Scoped thread limits and seeded torch generators for the tiny models of the suite.

On a loaded 2-core machine a multi-threaded BLAS call on a 64 x 64 matrix can take
100x longer than a single-threaded one (threads spin waiting for cores), and so can
torch on tiny MLPs. :func:`single_thread` and :func:`torch_threads` limit the threads
inside a block and restore the previous settings afterwards; nothing is changed
globally. :func:`torch_generator` turns the caller's numpy generator into a torch one,
so randomness always flows from an explicit generator.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


@functools.cache
def _controller() -> Any:
    """The BLAS thread-pool controller (scanning the loaded libraries is slow)."""
    from threadpoolctl import ThreadpoolController  # type: ignore[import-untyped]

    return ThreadpoolController()


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the block with one torch thread and one BLAS thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _controller().limit(limits=1, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op torch threads, then restore the old count."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"threads must be an integer >= 1, got {n!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def torch_generator(rng: np.random.Generator | torch.Generator) -> torch.Generator:
    """A CPU :class:`torch.Generator` seeded from ``rng`` (or ``rng`` itself)."""
    if isinstance(rng, torch.Generator):
        return rng
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            "rng must be a numpy.random.Generator or a torch.Generator, "
            f"got {type(rng).__name__}"
        )
    generator = torch.Generator()
    generator.manual_seed(int(rng.integers(2**62)))
    return generator
