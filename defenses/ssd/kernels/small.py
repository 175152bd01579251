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
   :math:`e^{(f_i - \max f)/T}` in one loop, their total;
2. the draw as a branch-free scan over the columns: a row's label is the first
   column with positive weight whose running weight exceeds :math:`u \sum_i w_i`
   (or the last column with positive weight), which is the row kernel's rule;
3. the trivial test :math:`\sum_i (q_i - f_i)_+ \le B/2` against the drawn
   prototypes;
4. for the rows left, the projection in lockstep: both levels' Newton iterations
   (:mod:`.projection`) run for all those rows at once, with 0/1 masks for the
   active sets instead of compacted index lists; a row whose iteration has ended
   keeps its level while the others go on. Every sum adds the same terms in the
   same order as the row kernel (a masked-out term adds an exact zero), so each
   row's answer is the row kernel's.

A Newton step that does not end the iteration removes at least one index from an
active set of at most K, so the iteration ends within K steps; the caller uses this
kernel only for :math:`K \le` ``max_steps``, where the row kernel never falls back
to sorting either.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.ssd.kernels import simd, simd_inlined
from defenses.ssd.kernels.elementary import counter_uniform, exp_row, log_row

SMALL_K = 16
"""Largest K served by this kernel (above it the row kernel is faster)."""
BLOCK_ROWS = 64
"""Rows per block: the lanes of every loop (scratch of 8 x 64 x K floats, in L1)."""


@simd_inlined
def _sums(
    values: FloatArray,
    other: FloatArray,
    acc: FloatArray,
    k: int,
    m: int,
    out: FloatArray,
    negate: bool,
) -> None:
    """Row sums of ``values`` (times ``other``, if it has entries), negated if asked.

    The row kernel's order: four accumulators by column modulo 4, the last
    ``k % 4`` columns in the first, combined as ``(a0 + a1) + (a2 + a3)``.
    """
    lanes = k - k % 4
    product = other.shape[0] > 0
    for j in range(4):
        for r in range(m):
            acc[j, r] = 0.0
    for c in range(k):
        j = c % 4 if c < lanes else 0
        base = c * BLOCK_ROWS
        for r in range(m):
            v = values[base + r]
            if product:
                v = v * other[base + r]
            acc[j, r] += v
    for r in range(m):
        total = (acc[0, r] + acc[1, r]) + (acc[2, r] + acc[3, r])
        out[r] = -total if negate else total


@simd_inlined
def _level_lockstep(
    ratio: FloatArray,
    fs: FloatArray,
    qs: FloatArray,
    alive: FloatArray,
    lanes: FloatArray,
    h: FloatArray,
    sign: float,
    level: FloatArray,
    work: FloatArray,
    k: int,
    m: int,
    max_steps: int,
) -> None:
    r"""One level (``sign`` 1: :math:`w_A`, -1: :math:`w_B`) for ``m`` rows at once.

    ``alive`` (K x BLOCK_ROWS, 0/1) is each row's active set; ``lanes`` holds per
    row its size, its sums of ``fs`` and ``qs`` and whether the row is done (1.0:
    ``level`` is final and kept). The step is :func:`~.projection._level`'s: the
    level from the sums, then the indices with :math:`\operatorname{sign}(r_i - w)
    < 0` kept; a row ends when a step keeps all its indices or none. Every loop
    runs over the rows with no branch, so that the compiler vectorizes it.
    """
    count = lanes[0]
    sum_f = lanes[1]
    sum_q = lanes[2]
    done = lanes[3]
    new_f = work[0]
    new_q = work[1]
    kept = work[2]
    trial = work[3]
    for i in range(m):
        empty = done[i] == 0.0 and count[i] == 0.0
        if empty:
            level[i] = 0.0 if sign > 0.0 else np.inf
            done[i] = 1.0
    for _ in range(max_steps):
        for i in range(m):
            trial[i] = (sum_f[i] + sign * h[i]) / sum_q[i]
            new_f[i] = 0.0
            new_q[i] = 0.0
            kept[i] = 0.0
        for c in range(k):
            base = c * BLOCK_ROWS
            for i in range(m):
                keep = alive[base + i] * np.float64(
                    sign * (ratio[base + i] - trial[i]) < 0.0
                )
                alive[base + i] = keep
                kept[i] += keep
                new_f[i] += fs[base + i] * keep
                new_q[i] += qs[base + i] * keep
        left = 0.0
        for i in range(m):
            end = np.float64((kept[i] == count[i]) | (kept[i] == 0.0))
            going = 1.0 - done[i]
            level[i] = trial[i] if going * end > 0.0 else level[i]
            done[i] = max(done[i], end)
            more = going * (1.0 - end)
            count[i] = kept[i] if more > 0.0 else count[i]
            sum_f[i] = new_f[i] if more > 0.0 else sum_f[i]
            sum_q[i] = new_q[i] if more > 0.0 else sum_q[i]
            left += more
        if left == 0.0:
            return


@simd
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
    ``K <= min(SMALL_K, max_steps)``.
    """
    k = f.shape[1]
    epsilon = settings[0]
    constant = settings[1]
    temperature = settings[2]
    floor = settings[3]
    width = k * BLOCK_ROWS
    block = np.ones((3, width))
    xs = block[0]
    work = block[1]
    spare = block[2]
    bits = block.view(np.int64)
    spare_bits = bits[2]
    matrices = np.ones((2, width))
    qs = matrices[0]
    ratio = matrices[1]
    lower = work  # free once the labels are drawn
    upper = spare
    none = np.empty(0)
    acc = np.empty((4, BLOCK_ROWS))
    per_row = np.zeros((14, BLOCK_ROWS))
    largest = per_row[0]
    negatives = per_row[1]
    usable = per_row[2]
    entropy = per_row[3]
    threshold = per_row[4]
    running = per_row[5]
    finished = per_row[6]
    half = per_row[7]
    raised = per_row[8]
    level_start = per_row[9]
    trivial = per_row[10]
    w_a = per_row[11]
    w_b = per_row[12]
    below = per_row[13]
    lanes_a = np.zeros((4, BLOCK_ROWS))
    lanes_b = np.zeros((4, BLOCK_ROWS))
    level_work = np.empty((4, BLOCK_ROWS))
    label = np.empty(BLOCK_ROWS, dtype=np.int64)
    worst = 0.0
    worst_row = start
    negative = 0.0
    for lo in range(start, stop, BLOCK_ROWS):
        m = min(BLOCK_ROWS, stop - lo)
        for r in range(m):
            for c in range(k):
                xs[c * BLOCK_ROWS + r] = np.float64(f[lo + r, c])
        for r in range(m):
            largest[r] = -np.inf
            negatives[r] = 0.0
        for c in range(k):
            base = c * BLOCK_ROWS
            for r in range(m):
                v = xs[base + r]
                largest[r] = max(largest[r], v)
                negatives[r] += np.float64(v < 0.0)
        _sums(xs, none, acc, k, m, running, False)
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
        _sums(xs, work, acc, k, m, entropy, True)
        if temperature > 0.0:
            for c in range(k):
                base = c * BLOCK_ROWS
                for r in range(m):
                    work[base + r] = (xs[base + r] - largest[r]) / temperature
            exp_row(work, work, spare, spare_bits)
        else:
            for c in range(k):
                base = c * BLOCK_ROWS
                for r in range(m):
                    work[base + r] = max(xs[base + r], 0.0)
        _sums(work, none, acc, k, m, threshold, False)
        for r in range(m):
            u = (
                uniforms[lo + r]
                if uniforms.shape[0]
                else counter_uniform(key, counter + np.uint64(lo + r))
            )
            threshold[r] = u * threshold[r]
            running[r] = 0.0
            label[r] = -1
            finished[r] = 0.0
        for c in range(k):
            base = c * BLOCK_ROWS
            for r in range(m):
                w = work[base + r]
                running[r] += w
                take = np.float64(w > 0.0) * (1.0 - finished[r])
                label[r] = c if take > 0.0 else label[r]
                finished[r] = max(
                    finished[r], take * np.float64(running[r] > threshold[r])
                )
        for r in range(m):
            if usable[r] == 0.0:
                label[r] = 0
                continue
            if label[r] < 0:
                best = 0
                for c in range(1, k):
                    if xs[c * BLOCK_ROWS + r] > xs[best * BLOCK_ROWS + r]:
                        best = c
                label[r] = best
            if labels.shape[0]:
                labels[lo + r] = label[r]
        if not out.shape[0]:
            continue
        for r in range(m):
            scale = constant if constant >= 0.0 else epsilon * entropy[r]
            half[r] = 0.5 * scale
            raised[r] = 0.0
            below[r] = 0.0
            running[r] = 0.0
        for c in range(k):
            base = c * BLOCK_ROWS
            for r in range(m):
                qv = prototypes[label[r], c]
                fv = xs[base + r]
                qs[base + r] = qv
                raised[r] += np.float64(qv < floor)
                inside = np.float64(fv < qv)
                below[r] += fv * inside
                running[r] += qv * inside
        for r in range(m):
            trivial[r] = np.float64(
                (raised[r] == 0.0) & (running[r] - below[r] <= half[r])
            )
        for r in range(m):
            level_start[r] = 0.0
        for c in range(k):
            base = c * BLOCK_ROWS
            for r in range(m):
                qv = max(qs[base + r], floor)
                qs[base + r] = qv
                level_start[r] += qv
                ratio[base + r] = xs[base + r] / qv
        for r in range(m):
            mass = level_start[r] if raised[r] > 0.0 else 1.0
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
            base = c * BLOCK_ROWS
            for r in range(m):
                rv = ratio[base + r]
                low = np.float64(rv < level_start[r])
                high = np.float64(rv > level_start[r])
                lower[base + r] = low
                upper[base + r] = high
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
            skip = (trivial[r] > 0.0) | (usable[r] == 0.0) | early
            trivial[r] = 2.0 if early and trivial[r] == 0.0 else trivial[r]
            lanes_a[3, r] = np.float64(skip)
            lanes_b[3, r] = np.float64(skip)
        _level_lockstep(
            ratio, xs, qs, lower, lanes_a, half, 1.0, w_a, level_work, k, m, max_steps
        )
        _level_lockstep(
            ratio, xs, qs, upper, lanes_b, half, -1.0, w_b, level_work, k, m, max_steps
        )
        for r in range(m):
            if usable[r] == 0.0:
                continue
            row = lo + r
            if trivial[r] == 1.0:
                q = prototypes[label[r]]
                for c in range(k):
                    out[row, c] = q[c]
            elif trivial[r] == 2.0:
                for c in range(k):
                    out[row, c] = qs[c * BLOCK_ROWS + r] * level_start[r]
            else:
                for c in range(k):
                    qv = qs[c * BLOCK_ROWS + r]
                    fv = xs[c * BLOCK_ROWS + r]
                    out[row, c] = min(max(fv, w_a[r] * qv), w_b[r] * qv)
    result = np.empty(3)
    result[0] = worst
    result[1] = worst_row
    result[2] = negative
    return result
