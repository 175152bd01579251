"""Scoped single-threading for the tiny linear algebra of the inversion game.

On a loaded 2-core machine a multi-threaded BLAS call on a 64 x 64 matrix can take
100x longer than a single-threaded one (threads spin waiting for cores), and so can
torch on tiny MLPs. :func:`single_thread` limits both inside a block and restores the
previous settings afterwards; nothing is changed globally.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

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
