r"""The whole SSD call at small K, vectorized across rows (:func:`shield_rows_small`).

At K = 10 a row has too few entries for SIMD code within it: the row kernel
(:func:`~.shield.shield_rows`) spends most of a row on loop set-up, branches that
depend on the data (the draw, the trivial test, the Newton steps) and the few
entries' ``log`` and ``exp``. This kernel computes the same answers, bit for bit,
with the rows as the SIMD lanes: it copies a block of :data:`BLOCK_ROWS` rows into
a column-major scratch (entry ``(c, r)`` at ``c * BLOCK_ROWS + r``), so that every
step is a loop over the block's rows with no branch:

1. the row checks (sum in the row kernel's four accumulators, in its order),
   the ``log`` of the whole block in one loop, the entropy, the weights
   :math:`e^{(f_i - \max f) s}`, :math:`s = 1/T` rounded, in one loop, their total;
2. the draw as a branch-free scan over the columns: a row's label is the first
   column with positive weight whose running weight exceeds :math:`u \sum_i w_i`
   (or the last column with positive weight), which is the row kernel's rule;
3. the trivial test :math:`\sum_i (q_i - f_i)_+ \le B/2` against the drawn
   prototypes;
4. for the rows left, the projection in lockstep: both levels' Newton iterations
   (:mod:`.projection`'s, as :func:`.lockstep.level_lockstep`) run for all those rows at
   once, each row's active set given by a running bound on the ratios (a 0/1 factor
   per term) instead of a compacted index list; a row whose iteration has ended keeps
   its level while the others go on. Every sum adds the same terms in the same order
   as the row kernel (a left-out term adds an exact zero), so each row's answer is the
   row kernel's.

A Newton step that does not end the iteration removes at least one index from an
active set of at most K, so the iteration ends within K steps; the caller uses this
kernel only for :math:`K \le` ``max_steps``, where the row kernel never falls back
to sorting either.

Memory: a block's scratch, (3 K + 31) x 64 floats (31 KB at K = 10: the block, two
K x 64 blocks for ``log`` and ``exp`` that then hold the floored prototypes and the
ratios, and the per-row vectors), would be 4 % of a 10,000-row input. With answers
it lives instead in the answer's rows that are written last: the 64-row blocks run
up to the last :func:`tail_rows` rows of the range and keep their scratch there;
those rows run in 8-row blocks the same way
(scratch of (3 K + 31) x 8 floats in the last rows again), and the last few rows
(50 at K = 10 in float64) in the row kernel, which needs only 7 K floats. Each
thread's range is done so within itself, so a call allocates the answer and a few
hundred bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba.misc.special import literally

from defenses.arrays import FloatArray, IntArray
from defenses.ssd.kernels import simd_inlined, simd_wide
from defenses.ssd.kernels.elementary import (
    INVERSE_CAP,
    counter_uniform,
    exp_row,
    log_row,
)
from defenses.ssd.kernels.lockstep import block_sums, level_lockstep
from defenses.ssd.kernels.shield import shield_rows

SMALL_K = 16
"""Largest K served by this kernel (above it the row kernel is faster)."""
BLOCK_ROWS = 64
"""Rows per block: the lanes of every loop (a scratch of (3 K + 31) x 64 floats)."""
TAIL_BLOCK_ROWS = 8
"""Rows per block for the rows whose answers hold the 64-row blocks' scratch."""
PER_ROW = 31
"""Per-row vectors of a block in the scratch (sums, lockstep lanes, labels, levels)."""
ALIGNMENT = 64
"""Bytes: the scratch in the answer starts on a cache-line boundary (see below)."""


@simd_inlined
def scratch_words(k: int, block_rows: int) -> int:
    """Float64s of a block's scratch: three K x ``block_rows`` blocks and vectors."""
    return (3 * k + PER_ROW) * block_rows


@simd_inlined
def tail_rows(k: int, itemsize: int, block_rows: int) -> int:
    """Answer rows (of ``itemsize`` bytes per entry) that hold one block's scratch.

    The scratch starts at the first :data:`ALIGNMENT`-byte boundary at or after the
    tail's first row (:func:`scratch_start`), hence ``ALIGNMENT`` bytes more.
    """
    entries = (8 * scratch_words(k, block_rows) + ALIGNMENT) // itemsize
    return -(-entries // k)


@simd_inlined
def scratch_start(out: npt.NDArray[np.floating[Any]], first_row: int) -> int:
    """The flat answer's first index on an :data:`ALIGNMENT` boundary from a row on.

    The boundary is the first at or after row ``first_row``. Every column of a
    block then starts on a 32-byte boundary (64 and 8 rows of float64 are 512 and
    64 bytes). Where the answer put the scratch decided it before: with a column 16
    bytes off a 32-byte boundary every 4-wide load and store of the lanes crossed
    one, and the kernel took 1.2x its time (K = 10: 118 against 98 ns a row; two of
    the eight offsets of a float64 answer were fast).
    """
    first = first_row * out.shape[1]
    shift = -int(out.ctypes.data + first * out.itemsize) % ALIGNMENT
    return int(first + shift // out.itemsize)


@simd_wide
def _lanes(
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
) -> FloatArray:
    """Rows ``start:stop`` in blocks of ``block_rows`` rows (see ``shield_rows_small``).

    ``scratch`` (float64, at least :func:`scratch_words` entries) holds the block and
    every per-row vector; its contents on entry do not matter. ``block_rows`` is
    compiled in as a constant (one specialization per value): as a runtime stride it
    cost 1.6x the time of every column loop.
    """
    literally(block_rows)
    k = f.shape[1]
    epsilon = settings[0]
    constant = settings[1]
    temperature = settings[2]
    inverse = min(1.0 / temperature, INVERSE_CAP)
    floor = settings[3]
    width = k * block_rows
    scratch[: 3 * width] = 1.0
    scratch[3 * width : scratch_words(k, block_rows)] = 0.0
    block = scratch[: 3 * width].reshape((3, width))
    xs = block[0]
    work = block[1]
    spare = block[2]
    bits = block.view(np.int64)
    spare_bits = bits[2]
    qs = spare  # free once the labels are drawn
    ratio = work
    none = scratch[:0]
    vectors = scratch[3 * width : scratch_words(k, block_rows)].reshape(
        (PER_ROW, block_rows)
    )
    acc = vectors[0:4]
    lanes_a = vectors[4:8]
    lanes_b = vectors[8:12]
    level_work = vectors[12:16]
    label = vectors[16].view(np.int64)
    largest = vectors[17]
    drawn = largest  # free once the weights are made
    negatives = vectors[18]
    usable = vectors[19]
    entropy = vectors[20]
    threshold = vectors[21]
    running = vectors[22]
    finished = vectors[23]
    half = vectors[24]
    raised = vectors[25]
    level_start = vectors[26]
    trivial = vectors[27]
    w_a = vectors[28]
    w_b = vectors[29]
    below = vectors[30]
    worst = 0.0
    worst_row = start
    negative = 0.0
    for lo in range(start, stop, block_rows):
        m = min(block_rows, stop - lo)
        for c in range(k):
            base = c * block_rows
            for r in range(m):
                xs[base + r] = np.float64(f[lo + r, c])
        for r in range(m):
            largest[r] = -np.inf
            negatives[r] = 0.0
        for c in range(k):
            base = c * block_rows
            for r in range(m):
                v = xs[base + r]
                largest[r] = max(largest[r], v)
                negatives[r] += np.float64(v < 0.0)
        block_sums(xs, none, acc, k, block_rows, m, running, False)
        for r in range(m):
            total = running[r]
            if negatives[r] > 0.0:
                negative = -1.0
            usable[r] = np.float64(np.isfinite(total))
            if usable[r] == 0.0:
                if np.isfinite(worst):
                    worst = np.nan
                    worst_row = lo + r
                continue
            if abs(total - 1.0) > worst:
                worst = abs(total - 1.0)
                worst_row = lo + r
        log_row(xs, work, spare, bits)
        block_sums(xs, work, acc, k, block_rows, m, entropy, True)
        if temperature > 0.0:
            for c in range(k):
                base = c * block_rows
                for r in range(m):
                    work[base + r] = (xs[base + r] - largest[r]) * inverse
            exp_row(work, work, spare, spare_bits)
        else:
            for c in range(k):
                base = c * block_rows
                for r in range(m):
                    work[base + r] = max(xs[base + r], 0.0)
        block_sums(work, none, acc, k, block_rows, m, threshold, False)
        for r in range(m):
            u = (
                uniforms[lo + r]
                if uniforms.shape[0]
                else counter_uniform(key, counter + np.uint64(lo + r))
            )
            threshold[r] = u * threshold[r]
            running[r] = 0.0
            drawn[r] = -1.0
            finished[r] = 0.0
        for c in range(k):
            base = c * block_rows
            column = np.float64(c)
            for r in range(m):
                w = work[base + r]
                run = running[r] + w
                running[r] = run
                was = finished[r]
                take = (w > 0.0) & (was == 0.0)
                label_r = drawn[r]
                drawn[r] = column if take else label_r
                finished[r] = 1.0 if take & (run > threshold[r]) else was
        for r in range(m):
            label[r] = int(drawn[r])
        for r in range(m):
            if usable[r] == 0.0:
                label[r] = 0
                continue
            if label[r] < 0:
                best = 0
                for c in range(1, k):
                    if xs[c * block_rows + r] > xs[best * block_rows + r]:
                        best = c
                label[r] = best
            if labels.shape[0]:
                labels[lo + r] = label[r]
        if not out.shape[0]:
            continue
        for r in range(m):
            budget = epsilon * entropy[r]
            scale = constant if constant >= 0.0 else budget
            half[r] = 0.5 * scale
            raised[r] = 0.0
            below[r] = 0.0
            running[r] = 0.0
            level_start[r] = 0.0
        # the prototypes gathered in a loop of their own: a gather by label in the
        # pass below kept that pass from vectorizing (15.8 against 8.8 ns a row for
        # both loops alone, K = 10)
        for c in range(k):
            base = c * block_rows
            for r in range(m):
                qs[base + r] = prototypes[label[r], c]
        for c in range(k):
            base = c * block_rows
            for r in range(m):
                qv = qs[base + r]
                fv = xs[base + r]
                raised[r] += np.float64(qv < floor)
                inside = np.float64(fv < qv)
                below[r] += fv * inside
                running[r] += qv * inside
                qv = max(qv, floor)
                qs[base + r] = qv
                level_start[r] += qv
                ratio[base + r] = fv / qv
        for r in range(m):
            trivial[r] = np.float64(
                (raised[r] == 0.0) & (running[r] - below[r] <= half[r])
            )
        for r in range(m):
            total_q = level_start[r]
            mass = total_q if raised[r] > 0.0 else 1.0
            level_start[r] = 1.0 / mass
            for j in range(3):
                lanes_a[j, r] = 0.0
                lanes_b[j, r] = 0.0
        count_a = lanes_a[0]
        count_b = lanes_b[0]
        sum_fa = lanes_a[1]
        sum_qa = lanes_a[2]
        sum_fb = lanes_b[1]
        sum_qb = lanes_b[2]
        for c in range(k):
            base = c * block_rows
            for r in range(m):
                rv = ratio[base + r]
                low = np.float64(rv < level_start[r])
                high = np.float64(rv > level_start[r])
                fv = xs[base + r]
                qv = qs[base + r]
                count_a[r] += low
                sum_fa[r] += fv * low
                sum_qa[r] += qv * low
                count_b[r] += high
                sum_fb[r] += fv * high
                sum_qb[r] += qv * high
        for r in range(m):
            early = level_start[r] * lanes_a[2, r] - lanes_a[1, r] <= half[r]
            kind = trivial[r]
            skip = (kind > 0.0) | (usable[r] == 0.0) | early
            trivial[r] = 2.0 if early & (kind == 0.0) else kind
            lanes_a[3, r] = np.float64(skip)
            lanes_b[3, r] = np.float64(skip)
        bound = threshold  # free once the labels are drawn
        for r in range(m):
            bound[r] = level_start[r]
        level_lockstep(
            ratio, xs, qs, bound, lanes_a, half, 1.0, w_a, level_work, k, block_rows,
            m, max_steps,
        )  # fmt: skip
        for r in range(m):
            bound[r] = level_start[r]
        level_lockstep(
            ratio, xs, qs, bound, lanes_b, half, -1.0, w_b, level_work, k, block_rows,
            m, max_steps,
        )  # fmt: skip
        for r in range(m):
            # a trivial row's answer is its prototype (raised == 0: q_i = max(q_i,
            # floor)), an early one's the scaled floored prototype: both are the
            # clip below with equal levels, min(max(f, w q), w q) = w q exactly
            # (operands loaded before the selects, so that the loop vectorizes)
            kind = trivial[r]
            scaled = level_start[r]
            w_lo = w_a[r]
            w_hi = w_b[r]
            w_lo = scaled if kind == 2.0 else w_lo
            w_hi = scaled if kind == 2.0 else w_hi
            w_a[r] = 1.0 if kind == 1.0 else w_lo
            w_b[r] = 1.0 if kind == 1.0 else w_hi
        for r in range(m):
            if usable[r] == 0.0:
                continue
            w_lo = w_a[r]
            w_hi = w_b[r]
            for c in range(k):
                qv = qs[c * block_rows + r]
                fv = xs[c * block_rows + r]
                out[lo + r, c] = min(max(fv, w_lo * qv), w_hi * qv)
    result = np.empty(3)
    result[0] = worst
    result[1] = worst_row
    result[2] = negative
    return result


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
    """Blocks of ``block_rows`` rows from ``start`` up to the scratch's tail rows.

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
    part = _lanes(
        f, prototypes, uniforms, key, counter, settings, max_steps, start,
        stop - tail, block_rows, scratch, out, labels,
    )  # fmt: skip
    _merge(result, part)
    return stop - tail


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
    ``K <= min(SMALL_K, max_steps)``. With answers, the blocks' scratch lives in the
    answer rows not yet written: 64-row blocks up to the last :func:`tail_rows`
    rows, whose answers hold their scratch; then 8-row blocks the same way; the
    last few rows by the row kernel. Nothing of the size of a block is allocated.
    Without answers (labels only) one 64-row scratch is allocated.
    """
    k = f.shape[1]
    if not out.shape[0]:
        scratch = np.empty(scratch_words(k, BLOCK_ROWS))
        return _lanes(
            f, prototypes, uniforms, key, counter, settings, max_steps, start, stop,
            BLOCK_ROWS, scratch, out, labels,
        )  # fmt: skip
    result = np.zeros(3)
    result[1] = start
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
