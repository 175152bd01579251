r"""The whole SSD call at small K, vectorized across rows (:func:`shield_rows_small`).

At K = 10 a row has too few entries for SIMD code within it: the row kernel
(:func:`~.shield.shield_rows`) spends most of a row on loop set-up, branches that
depend on the data (the draw, the trivial test, the Newton steps) and the few
entries' ``log`` and ``exp``. This kernel computes the same answers, bit for bit,
with the rows as the SIMD lanes, in blocks of :data:`~.lanes.BLOCK_ROWS` rows
(:func:`~.lanes.shield_lanes`, which says how).

Memory: a block's scratch, (3 K + 31) x 64 floats (31 KB at K = 10: the block, two
K x 64 blocks for ``log`` and ``exp`` that then hold the floored prototypes and the
ratios, and the per-row vectors), would be 4 % of a 10,000-row input. With answers
it lives instead in the answer's rows that are written last: whole 64-row blocks
run up to the last :func:`tail_rows` rows of the range and keep their scratch there;
the rows left run in whole 8-row blocks the same way (scratch of (3 K + 31) x 8
floats in the last rows again), and the last few rows (50 to 57 at K = 10 in
float64) in the row kernel, which needs only 7 K floats. Each thread's range is
done so within itself, so a call allocates the answer and a few hundred bytes.
The rows in those tails run slower (8-row blocks take about twice a 64-row
block's time a row, the row kernel three times), so a batch shorter than
:data:`LARGE_BATCH_TAILS` tails (3,920 rows at K = 10 in float64), where they
would be 10 % of the rows or more, allocates one 64-row scratch instead: its
extra memory is the answer and that scratch (31 KB at K = 10), and a 256-row call
takes 0.45x the time it took with the scratch in its answer.
Whole blocks only, so that every loop over a block's rows has a count known when
compiling (the kernel 0.97x its time with the last block's count read at run time).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.ssd.kernels import simd_inlined, simd_wide
from defenses.ssd.kernels.lanes import (
    BLOCK_ROWS,
    TAIL_BLOCK_ROWS,
    scratch_words,
    shield_lanes,
)
from defenses.ssd.kernels.shield import shield_rows

SMALL_K = 16
"""Largest K served by this kernel (above it the row kernel is faster)."""
ALIGNMENT = 64
"""Bytes: a block scratch starts on a cache-line boundary (see ``scratch_start``)."""
LARGE_BATCH_TAILS = 10
"""A range of at least this many 64-row tails keeps its scratch in the answer."""


@simd_inlined
def tail_rows(k: int, itemsize: int, block_rows: int) -> int:
    """Answer rows (of ``itemsize`` bytes per entry) that hold one block's scratch.

    The scratch starts at the first :data:`ALIGNMENT`-byte boundary at or after the
    tail's first row (:func:`scratch_start`), hence ``ALIGNMENT`` bytes more.
    """
    entries = (8 * scratch_words(k, block_rows) + ALIGNMENT) // itemsize
    return -(-entries // k)


@simd_inlined
def _aligned_index(flat: npt.NDArray[np.floating[Any]], first: int) -> int:
    """Index of the first entry of ``flat`` on an :data:`ALIGNMENT` boundary.

    The first such entry at or after entry ``first``.
    """
    shift = -int(flat.ctypes.data + first * flat.itemsize) % ALIGNMENT
    return int(first + shift // flat.itemsize)


@simd_inlined
def scratch_start(out: npt.NDArray[np.floating[Any]], first_row: int) -> int:
    """The flat answer's first index on an :data:`ALIGNMENT` boundary from a row on.

    The boundary is the first at or after row ``first_row``. Every column of a
    block then starts on a cache line, the width of a 512-bit vector (64 and 8 rows
    of float64 are 512 and 64 bytes). Where the answer put the scratch decided it
    before: with a column 16 bytes off a 32-byte boundary every 4-wide load and
    store of the lanes crossed one, and the kernel took 1.2x its time (K = 10: 118
    against 98 ns a row; two of the eight offsets of a float64 answer were fast).
    """
    return _aligned_index(out.reshape(-1), first_row * out.shape[1])


@simd_inlined
def aligned_scratch(words: int) -> FloatArray:
    """``words`` new float64s starting on an :data:`ALIGNMENT` boundary."""
    buffer = np.empty(words + ALIGNMENT // 8)
    first = _aligned_index(buffer, 0)
    return buffer[first : first + words]


@simd_inlined
def _merge(total: FloatArray, part: FloatArray) -> None:
    """Fold the statistics of a later range of rows into ``total``, in row order.

    The first NaN stays; else the larger deviation (the earlier row on a tie); any
    negative entry.
    """
    if np.isfinite(total[0]) and (not np.isfinite(part[0]) or part[0] > total[0]):
        total[0] = part[0]
        total[1] = part[1]
    total[2] = min(total[2], part[2])


@simd_inlined
def _blocks(
    f: npt.NDArray[np.floating[Any]],
    prototypes: FloatArray,
    uniforms: FloatArray,
    key: np.uint64,
    counter: np.uint64,
    settings: FloatArray,
    max_steps: int,
    start: int,
    stop: int,
    block_rows: int,
    scratch: FloatArray,
    out: npt.NDArray[np.floating[Any]],
    labels: IntArray,
    result: FloatArray,
) -> int:
    """Whole blocks of ``block_rows`` rows from ``start``, none past ``stop``.

    The statistics are folded into ``result``; returns the first row left.
    """
    end = start + (stop - start) // block_rows * block_rows
    if end > start:
        part = shield_lanes(
            f, prototypes, uniforms, key, counter, settings, max_steps, start, end,
            block_rows, scratch, out, labels,
        )  # fmt: skip
        _merge(result, part)
    return end


@simd_inlined
def _tail_phase(
    f: npt.NDArray[np.floating[Any]],
    prototypes: FloatArray,
    uniforms: FloatArray,
    key: np.uint64,
    counter: np.uint64,
    settings: FloatArray,
    max_steps: int,
    start: int,
    stop: int,
    block_rows: int,
    out: npt.NDArray[np.floating[Any]],
    labels: IntArray,
    result: FloatArray,
) -> int:
    """Whole blocks of ``block_rows`` rows from ``start`` up to the scratch's tail rows.

    The scratch is the answer's rows from ``stop - tail_rows(...)`` on, which no
    block writes; the statistics are folded into ``result``. Returns the first row
    left (``start`` if the range is too short for a tail).
    """
    k = f.shape[1]
    tail = tail_rows(k, out.itemsize, block_rows)
    if stop - start <= tail:
        return start
    per_word = 8 // out.itemsize
    first = scratch_start(out, stop - tail)
    words = scratch_words(k, block_rows)
    scratch = out.reshape(-1)[first : first + words * per_word].view(np.float64)
    return _blocks(
        f, prototypes, uniforms, key, counter, settings, max_steps, start,
        stop - tail, block_rows, scratch, out, labels, result,
    )  # fmt: skip


@simd_wide
def shield_rows_small(
    f: npt.NDArray[np.floating[Any]],
    prototypes: FloatArray,
    uniforms: FloatArray,
    key: np.uint64,
    counter: np.uint64,
    settings: FloatArray,
    max_steps: int,
    start: int,
    stop: int,
    out: npt.NDArray[np.floating[Any]],
    labels: IntArray,
) -> FloatArray:
    """SSD on rows ``start:stop`` of ``f``: :func:`~.shield.shield_rows`, row-batched.

    Same arguments, answers, labels and returned statistics, bit for bit, for
    ``K <= min(SMALL_K, max_steps)``. In an answer of at least
    :data:`LARGE_BATCH_TAILS` tails, each range (a thread's chunk) keeps the
    blocks' scratch in its answer rows not yet written: 64-row blocks up to the last
    :func:`tail_rows` rows, whose answers hold their scratch; then 8-row blocks the
    same way; the last few rows by the row kernel. Nothing of the size of a block is
    allocated. Otherwise (labels only, or a smaller batch, whose tails' slower
    phases would take 10 % of the rows or more) one 64-row scratch is allocated for
    the range's 64-row and then its 8-row blocks.
    """
    k = f.shape[1]
    result = np.zeros(3)
    result[1] = start
    tail = tail_rows(k, out.itemsize, BLOCK_ROWS)
    if out.shape[0] < LARGE_BATCH_TAILS * tail:  # labels only, or a small batch
        scratch = aligned_scratch(scratch_words(k, BLOCK_ROWS))
        lo = _blocks(
            f, prototypes, uniforms, key, counter, settings, max_steps, start, stop,
            BLOCK_ROWS, scratch, out, labels, result,
        )  # fmt: skip
        lo = _blocks(
            f, prototypes, uniforms, key, counter, settings, max_steps, lo, stop,
            TAIL_BLOCK_ROWS, scratch, out, labels, result,
        )  # fmt: skip
    else:
        lo = _tail_phase(
            f, prototypes, uniforms, key, counter, settings, max_steps, start, stop,
            BLOCK_ROWS, out, labels, result,
        )  # fmt: skip
        lo = _tail_phase(
            f, prototypes, uniforms, key, counter, settings, max_steps, lo, stop,
            TAIL_BLOCK_ROWS, out, labels, result,
        )  # fmt: skip
    if lo < stop:
        part = shield_rows(
            f, prototypes, uniforms, key, counter, settings, max_steps, lo, stop,
            out, labels,
        )  # fmt: skip
        _merge(result, part)
    return result
