r"""A block of rows as the SIMD lanes: the whole SSD call on 64 (or 8) rows at once.

:func:`shield_lanes` computes the row kernel's answers
(:func:`~.shield.shield_rows`), bit for bit, with the rows as the SIMD lanes: it
copies a block of :data:`BLOCK_ROWS` rows into a column-major scratch (entry
``(c, r)`` at ``c * BLOCK_ROWS + r``), so that every step is a loop over the
block's rows with no branch:

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
to sorting either. :func:`~.small.shield_rows_small` cuts a range of rows into
such blocks and places their scratch (see there).
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

BLOCK_ROWS = 64
"""Rows per block: the lanes of every loop (a scratch of (3 K + 31) x 64 floats)."""
TAIL_BLOCK_ROWS = 8
"""Rows per block for the rows whose answers hold the 64-row blocks' scratch."""
PER_ROW = 31
"""Per-row vectors of a block in the scratch (sums, lockstep lanes, labels, levels)."""


@simd_inlined
def scratch_words(k: int, block_rows: int) -> int:
    """Float64s of a block's scratch: three K x ``block_rows`` blocks and vectors."""
    return (3 * k + PER_ROW) * block_rows


@simd_wide
def shield_lanes(
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
    """Rows ``start:stop``, a multiple of ``block_rows`` (see :mod:`.small`).

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
    m = block_rows  # whole blocks: every loop over the rows has a constant count
    for lo in range(start, stop, block_rows):
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
