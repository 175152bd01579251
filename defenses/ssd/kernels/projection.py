r"""Compiled row loop of the water-filling projection (see :mod:`.waterfill`).

For one row, with :math:`q` floored (:math:`\max(q_i, \text{floor})`, mass :math:`s`)
and :math:`h = B/2`, the two water levels are the roots of

.. math::

    g_A(w) = \sum_i (w q_i - f_i)_+ = h, \qquad g_B(w) = \sum_i (f_i - w q_i)_+ = h,

two convex piecewise-linear functions (increasing and decreasing) with kinks at the
ratios :math:`r_i = f_i / q_i`. Both equal :math:`\mathrm{TV}(q/s, f)` at
:math:`w_0 = 1/s`, so the row is trivial exactly when :math:`g_A(w_0) \le h`.
Otherwise Newton's method started at :math:`w_0` converges monotonically, from
above for :math:`w_A` and from below for :math:`w_B` (a tangent of a convex function
lies below it), and each step is the paper's closed form on the current active set:

.. math::

    w_A \leftarrow \frac{\sum_{r_i < w_A} f_i + h}{\sum_{r_i < w_A} q_i}, \qquad
    w_B \leftarrow \frac{\sum_{r_i > w_B} f_i - h}{\sum_{r_i > w_B} q_i}.

The active sets only shrink, so each step scans the survivors of the previous one,
and the iteration ends, at the closed form's solution, when a step removes no
index. A row costs a few passes over :math:`K` entries and no sort (typically 3 and
7 steps at K = 1000 on random rows). A step is only sure to remove one index, so
after ``max_steps`` steps the survivors are sorted and walked as in the paper's
Algorithm 2, which bounds a row at :math:`O(K \log K)`.
"""

from __future__ import annotations

import numpy as np

from defenses.arrays import FloatArray, IntArray
from defenses.ssd.kernels import simd, simd_inlined


@simd
def _walk(
    ratio: FloatArray,
    f: FloatArray,
    q: FloatArray,
    alive: IntArray,
    h: float,
    raising: bool,
) -> float:
    """A level from the survivors ``alive`` by sorting them (Algorithm 2).

    :math:`w_A` walks the ratios upwards and stops where raising to the next one
    would cost more than ``h``; :math:`w_B` walks them downwards, lowering.
    """
    order = alive[np.argsort(ratio[alive])]
    if not raising:
        order = order[::-1]
    sum_f = 0.0
    sum_q = 0.0
    last = order.shape[0] - 1
    for j in range(last + 1):
        col = order[j]
        sum_f += f[col]
        sum_q += q[col]
        if j == last:
            break
        step = ratio[order[j + 1]] * sum_q
        if (step - sum_f if raising else sum_f - step) > h:
            break
    sign = 1.0 if raising else -1.0
    return (sum_f + sign * h) / sum_q


@simd_inlined
def _level(
    ratio: FloatArray,
    f: FloatArray,
    q: FloatArray,
    alive: IntArray,
    count: int,
    sum_f: float,
    sum_q: float,
    h: float,
    raising: bool,
    max_steps: int,
) -> float:
    """Newton's iteration for one level from the active set ``alive[:count]``.

    ``sum_f`` and ``sum_q`` are the sums over that set. ``raising`` selects
    :math:`w_A` (keep :math:`r_i < w`, add ``h``) or :math:`w_B` (keep
    :math:`r_i > w`, subtract ``h``); the sign of :math:`r_i - w` (exact for finite
    floats) tests both. ``alive`` is compacted in place. An empty set
    (a row whose ``f`` and ``q`` agree up to rounding) leaves that side unclipped.
    """
    if count == 0:
        return 0.0 if raising else np.inf
    sign = 1.0 if raising else -1.0
    for _ in range(max_steps):
        level = (sum_f + sign * h) / sum_q
        kept = 0
        sum_f = 0.0
        sum_q = 0.0
        for j in range(count):
            col = alive[j]
            keep = sign * (ratio[col] - level) < 0.0
            alive[kept] = col
            kept += int(keep)
            sum_f += f[col] * np.float64(keep)
            sum_q += q[col] * np.float64(keep)
        if kept == count or kept == 0:
            return level
        count = kept
    return _walk(ratio, f, q, alive[:count], h, raising)


@simd_inlined
def project_row(
    f_row: FloatArray,
    q_row: FloatArray,
    floor: float,
    h: float,
    max_steps: int,
    scratch: FloatArray,
    below: IntArray,
    above: IntArray,
    out_row: FloatArray,
) -> tuple[float, float, float, float]:
    """Water-fill one row of ``f`` towards ``q`` (half-budget ``h``) into ``out_row``.

    ``scratch`` (shape (2, K)) holds the ratios and the floored ``q``; ``below`` and
    ``above`` (length K) the active sets. Returns the sums and least entries of
    ``f_row`` and ``q_row`` (NaN and inf show in the sums). Entries of ``q`` are
    floored at ``floor`` and the levels are those of the unnormalised floored row, so
    only the trivial case divides by its mass (a row with no raised entry counts as
    mass 1.0 and stays bit for bit as given).
    """
    k = f_row.shape[0]
    ratio = scratch[0]
    floored = scratch[1]
    sum_f = 0.0
    sum_q = 0.0
    least_f = np.inf
    least_q = np.inf
    mass = 0.0
    raised = False
    for col in range(k):
        fv = np.float64(f_row[col])
        qv = q_row[col]
        sum_f += fv
        sum_q += qv
        least_f = min(least_f, fv)
        least_q = min(least_q, qv)
        raised |= qv < floor
        qv = max(qv, floor)
        mass += qv
        floored[col] = qv
        ratio[col] = fv / qv
    if not raised:
        mass = 1.0
    start = 1.0 / mass
    n_below = n_above = 0
    below_f = below_q = above_f = above_q = 0.0
    for col in range(k):
        r = ratio[col]
        lower = r < start
        upper = r > start
        below[n_below] = col
        above[n_above] = col
        n_below += int(lower)
        n_above += int(upper)
        fv = np.float64(f_row[col])
        in_below = np.float64(lower)
        in_above = np.float64(upper)
        below_f += fv * in_below
        below_q += floored[col] * in_below
        above_f += fv * in_above
        above_q += floored[col] * in_above
    if start * below_q - below_f <= h:
        for col in range(k):
            out_row[col] = floored[col] * start
        return sum_f, sum_q, least_f, least_q
    w_a = _level(
        ratio, f_row, floored, below, n_below, below_f, below_q, h, True, max_steps
    )
    w_b = _level(
        ratio, f_row, floored, above, n_above, above_f, above_q, h, False, max_steps
    )
    for col in range(k):
        qv = floored[col]
        out_row[col] = min(max(np.float64(f_row[col]), w_a * qv), w_b * qv)
    return sum_f, sum_q, least_f, least_q


@simd
def project_rows(
    f: FloatArray,
    q: FloatArray,
    floor: float,
    half: FloatArray,
    max_steps: int,
    stats: FloatArray,
    out: FloatArray,
) -> None:
    """Water-fill every row of ``f`` towards ``q``, writing ``out`` and ``stats``.

    ``stats`` (shape (N, 4)) receives the sums and least entries of the rows of ``f``
    and ``q``, for the caller's input checks; rows that fail them hold meaningless
    output.
    """
    n, k = f.shape
    scratch = np.empty((2, k))
    below = np.empty(k, dtype=np.int64)
    above = np.empty(k, dtype=np.int64)
    for row in range(n):
        sum_f, sum_q, least_f, least_q = project_row(
            f[row], q[row], floor, half[row], max_steps, scratch, below, above, out[row]
        )
        stats[row, 0] = sum_f
        stats[row, 1] = sum_q
        stats[row, 2] = least_f
        stats[row, 3] = least_q
