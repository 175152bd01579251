r"""Sums and Newton iterations over a block of rows in lockstep, for :mod:`.small`.

A block is column-major (entry ``(c, r)`` at ``c * block_rows + r``), so every loop
runs over the block's rows, the SIMD lanes, with no branch that depends on the data.
"""

from __future__ import annotations

import numpy as np

from defenses.arrays import FloatArray
from defenses.ssd.kernels import simd_inlined


@simd_inlined
def block_sums(
    values: FloatArray,
    other: FloatArray,
    acc: FloatArray,
    k: int,
    block_rows: int,
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
        base = c * block_rows
        for r in range(m):
            v = values[base + r]
            if product:
                v = v * other[base + r]
            acc[j, r] += v
    for r in range(m):
        total = (acc[0, r] + acc[1, r]) + (acc[2, r] + acc[3, r])
        out[r] = -total if negate else total


@simd_inlined
def level_lockstep(
    ratio: FloatArray,
    fs: FloatArray,
    qs: FloatArray,
    bound: FloatArray,
    lanes: FloatArray,
    h: FloatArray,
    sign: float,
    level: FloatArray,
    work: FloatArray,
    k: int,
    block_rows: int,
    m: int,
    max_steps: int,
) -> None:
    r"""One level (``sign`` 1: :math:`w_A`, -1: :math:`w_B`) for ``m`` rows at once.

    ``lanes`` holds per row the size of its active set, its sums of ``fs`` and
    ``qs`` and whether the row is done (1.0: ``level`` is final and kept); ``work``
    is a 4 x ``block_rows`` scratch. The step is :func:`~.projection._level`'s: the
    level :math:`w_t` from the sums, then the indices with
    :math:`\operatorname{sign}(r_i - w_t) < 0` kept; a row ends when a step keeps
    all its indices or none. The active set is not stored: it starts as
    :math:`\{i : \operatorname{sign}(r_i - b) < 0\}` with ``bound`` :math:`b` the
    starting level, and a step keeps the indices that pass every test so far, which
    for :math:`s = 1` is :math:`r_i < \min(b, w_1, \ldots, w_t)` (for finite
    :math:`r_i`, :math:`r_i - w < 0` exactly when :math:`r_i < w`, and a NaN level
    keeps nothing), for :math:`s = -1` the same with max; ``bound`` holds that
    running bound. So each step reads ``ratio``, ``fs`` and ``qs`` and writes no
    mask (a step cost 10 % less than with stored 0/1 masks). Every loop runs over
    the rows with no branch, so that the compiler vectorizes it.
    """
    count = lanes[0]
    sum_f = lanes[1]
    sum_q = lanes[2]
    done = lanes[3]
    trial = work[0]
    kept = work[1]
    new_f = work[2]
    new_q = work[3]
    unclipped = 0.0 if sign > 0.0 else np.inf
    for i in range(m):
        done_i = done[i]
        level_i = level[i]
        empty = (done_i == 0.0) & (count[i] == 0.0)
        level[i] = unclipped if empty else level_i
        done[i] = 1.0 if empty else done_i
    for _ in range(max_steps):
        for i in range(m):
            t = (sum_f[i] + sign * h[i]) / sum_q[i]
            trial[i] = t
            b = bound[i]
            bound[i] = t if (sign * (t - b) < 0.0) | (t != t) else b
            new_f[i] = 0.0
            new_q[i] = 0.0
            kept[i] = 0.0
        for c in range(k):
            base = c * block_rows
            for i in range(m):
                keep = np.float64(sign * (ratio[base + i] - bound[i]) < 0.0)
                kept[i] += keep
                new_f[i] += fs[base + i] * keep
                new_q[i] += qs[base + i] * keep
        left = 0
        for i in range(m):
            # every select's operands are loaded first: a select whose arm loads
            # (x[i] if c else y[i]) is a conditional load, which kept the compiler
            # from vectorizing the loop (1.3 against 0.2 ns a row in a loop alone);
            # the count is an integer sum (a float one is a reduction it must not
            # reorder)
            kept_i = kept[i]
            count_i = count[i]
            done_i = done[i]
            trial_i = trial[i]
            level_i = level[i]
            new_f_i = new_f[i]
            new_q_i = new_q[i]
            sum_f_i = sum_f[i]
            sum_q_i = sum_q[i]
            end = np.float64((kept_i == count_i) | (kept_i == 0.0))
            going = 1.0 - done_i
            level[i] = trial_i if going * end > 0.0 else level_i
            done[i] = max(done_i, end)
            more = going * (1.0 - end)
            count[i] = kept_i if more > 0.0 else count_i
            sum_f[i] = new_f_i if more > 0.0 else sum_f_i
            sum_q[i] = new_q_i if more > 0.0 else sum_q_i
            left += int(more > 0.0)
        if left == 0:
            return
