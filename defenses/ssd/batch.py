"""Batches of probability rows for the fused kernel: conversion, blocks, checks.

The kernel reads the caller's array in place when it is C-contiguous float32 or
float64 (a torch CPU tensor is viewed, not copied); other dtypes are converted once.
Large batches are cut into blocks of rows handed to a pool of threads (the kernel
releases the GIL); each block returns the statistics of its rows that the input
checks need, so no per-row array is kept.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.ssd.lazy import is_tensor, loaded_torch

if TYPE_CHECKING:
    import torch

PARALLEL_MIN_ENTRIES = 1 << 18
"""Batches with fewer entries (N K) run on one thread: starting more costs more."""

BLOCK_ENTRIES = 1 << 16
"""Entries per block of rows handed to a thread (512 KiB of float64, about L2)."""


def as_rows(
    probs: Any, name: str = "probs"
) -> tuple[npt.NDArray[np.floating[Any]], np.dtype[Any] | torch.dtype]:
    """``probs`` as a C-contiguous float32/float64 array (a view where possible).

    Returns the array and the dtype the caller gave (a torch dtype for a tensor;
    float64 for integers and booleans), whose rounding the sum check allows.
    Complex input raises TypeError: dropping the imaginary part would be silent.
    """
    given: np.dtype[Any] | torch.dtype
    if is_tensor(probs):
        torch_module = loaded_torch()
        assert torch_module is not None  # a tensor means torch is loaded
        if probs.is_complex():
            raise TypeError(f"{name} must be real, got {probs.dtype}")
        given = probs.dtype if probs.is_floating_point() else torch_module.float64
        tensor = probs.detach().cpu()
        if tensor.dtype not in (torch_module.float32, torch_module.float64):
            tensor = tensor.to(torch_module.float64)
        array = tensor.contiguous().numpy()
    else:
        array = np.asarray(probs)
        if array.dtype.kind == "c":
            raise TypeError(f"{name} must be real, got {array.dtype}")
        given = array.dtype if array.dtype.kind == "f" else np.dtype(np.float64)
    single = array.dtype.kind == "f" and array.itemsize <= 4
    work = np.float32 if single else np.float64
    rows: npt.NDArray[np.floating[Any]]
    try:
        rows = np.ascontiguousarray(array, dtype=work)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be an array of numbers: {error}") from error
    return rows, given


def frozen(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A read-only view of ``array`` (no copy).

    The kernels take their inputs as read-only arrays, so writable and read-only
    arrays (a broadcast, a pandas or memory-mapped buffer) share one compiled
    specialization instead of compiling a second one on their first call.
    """
    view = array.view()
    view.flags.writeable = False
    return view


def thread_count(n_threads: int | None, entries: int) -> int:
    """Threads for a batch of ``entries`` (N K): one below the threshold."""
    if entries < PARALLEL_MIN_ENTRIES:
        return 1
    if n_threads is not None:
        return int(n_threads)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def run_blocks(
    block: Callable[[tuple[int, int]], FloatArray],
    n: int,
    k: int,
    n_threads: int | None,
) -> list[FloatArray]:
    """Call ``block((start, stop))`` over rows ``0:n``, on threads when it pays."""
    threads = thread_count(n_threads, n * max(k, 1))
    if threads == 1:
        return [block((0, n))]
    step = max(1, BLOCK_ENTRIES // max(k, 1))
    blocks = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(block, blocks))


def check_stats(results: list[FloatArray], tolerance: float) -> None:
    """Raise ValueError unless every block's rows were finite, >= 0 and summed to 1.

    Each block returns (largest deviation of a row sum from 1, or NaN; its row; -1
    if an entry is negative). Read as Python floats: numpy's reductions cost more
    than the few blocks of a call.
    """
    stats = [block.tolist() for block in results]
    if not all(math.isfinite(deviation) for deviation, _, _ in stats):
        raise ValueError("probs contains NaN or inf")
    if any(negative < 0 for _, _, negative in stats):
        raise ValueError("probs has negative entries")
    deviation, row, _ = max(stats, key=lambda block: block[0], default=(0.0, 0, 0))
    if deviation > tolerance:
        raise ValueError(
            f"probs rows must sum to 1 (within {tolerance:.1e}); row "
            f"{int(row)} is off by {deviation:.3g}"
        )
