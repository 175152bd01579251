r"""The whole SSD call as one compiled row loop (:func:`shield_rows`).

For each row the kernel reads ``f`` once into a float64 row scratch, which stays in
cache (K = 1000: 8 KiB) for the passes that follow, and writes the answer once in
the caller's dtype; nothing of size N K is allocated:

1. the row's sum, largest entry and count of negative entries (the input checks),
   in four interleaved accumulators (a fixed order, so the same bits every run);
2. the entropy :math:`H = -\sum_i f_i \ln f_i` (:func:`~.elementary.log_row`);
3. the pseudo-label: the first index whose running weight exceeds
   :math:`u \sum_i w_i`, with :math:`w_i = e^{(f_i - \max f) s}`,
   :math:`s = \min(1/T, 10^{300})` rounded once (a multiplication an entry)
   (:func:`~.elementary.exp_row`; the weights of
   :math:`\operatorname{softmax}(f / T)` up to a common factor) or
   :math:`w_i = f_i` for the ablation without temperature;
4. the projection towards ``prototypes[y]`` within :math:`\varepsilon H`: first the
   trivial case's test, :math:`\sum_i (q_i - f_i)_+ \le B / 2`, in the same pass
   as the write of :math:`q_y` (the answer if the test holds, no division;
   :func:`_written_if_trivial`), else :func:`~.projection.project_row`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.ssd.kernels import simd, simd_inlined
from defenses.ssd.kernels.elementary import (
    INVERSE_CAP,
    counter_uniform,
    exp_row,
    log_row,
)
from defenses.ssd.kernels.projection import project_row

UNIT_ROUNDOFF = 2.0**-53
"""Half the distance from 1.0 to the next float64."""


@simd_inlined
def _reference_excess(f_row: FloatArray, q: FloatArray) -> float:
    r""":math:`\sum_i (q_i - f_i)_+`: two sums over :math:`f_i < q_i`, column order.

    The order that defines every kernel's trivial test (one accumulator each).
    """
    below_f = 0.0
    below_q = 0.0
    for col in range(f_row.shape[0]):
        qv = q[col]
        fv = f_row[col]
        inside = np.float64(fv < qv)
        below_f += fv * inside
        below_q += qv * inside
    return below_q - below_f


@simd_inlined
def _written_if_trivial(
    f_row: FloatArray,
    q: FloatArray,
    floor: float,
    half: float,
    out_row: npt.NDArray[np.floating[Any]],
) -> bool:
    r"""The trivial test, no ``q_i < floor`` and :math:`\sum_i (q_i - f_i)_+ \le h`.

    ``q`` is written to ``out_row`` in the same pass (the answer if the row is
    trivial; the projection overwrites it otherwise), and the test is decided as
    :func:`_reference_excess` decides it, from sums the compiler vectorizes (the
    reference's single accumulators are chains of dependent additions; the row
    kernel at K = 1000 took 7.2-7.7 µs a row with them and a separate write, 6.4-6.5
    µs with this, side by side). Here :math:`E' = \sum_i \operatorname{fl}(\max(q_i
    - f_i, 0))` in eight interleaved accumulators. With :math:`u = 2^{-53}`,
    :math:`S = \sum_{f_i < q_i} (q_i + |f_i|) \le B = \sum_i (q_i + |f_i|)`, and a
    sum whose terms each pass through at most :math:`m` rounded additions within
    :math:`\gamma_m S = m u S / (1 - m u)` of the exact sum (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2002, sec. 4.2): each term's subtraction
    costs :math:`u S`, the accumulators and their combination
    :math:`\gamma_{K/8 + 11}` (at :math:`K < 8` all terms share one accumulator and
    the combination adds zeros: :math:`\gamma_{K-1}`), the reference's
    :math:`\tilde Q - \tilde F` is within :math:`\gamma_{K-1} S` of the exact
    excess, and the total is below :math:`4 K u B` at every :math:`K \ge 1`. When
    :math:`E'` clears :math:`h` by that margin (plus :math:`2 u |h|`, a unit in the
    last place of :math:`h`, for the reference's rounded difference) its verdict is
    the reference's; otherwise the reference sums decide. Whether some :math:`q_i` is
    below ``floor`` is order-free (the least :math:`q_i`).
    """
    k = f_row.shape[0]
    lanes = k - k % 8
    e0 = e1 = e2 = e3 = e4 = e5 = e6 = e7 = 0.0
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = 0.0
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = np.inf
    for col in range(0, lanes, 8):
        e0 += max(q[col + 0] - f_row[col + 0], 0.0)
        b0 += q[col + 0] + abs(f_row[col + 0])
        m0 = min(m0, q[col + 0])
        out_row[col + 0] = q[col + 0]
        e1 += max(q[col + 1] - f_row[col + 1], 0.0)
        b1 += q[col + 1] + abs(f_row[col + 1])
        m1 = min(m1, q[col + 1])
        out_row[col + 1] = q[col + 1]
        e2 += max(q[col + 2] - f_row[col + 2], 0.0)
        b2 += q[col + 2] + abs(f_row[col + 2])
        m2 = min(m2, q[col + 2])
        out_row[col + 2] = q[col + 2]
        e3 += max(q[col + 3] - f_row[col + 3], 0.0)
        b3 += q[col + 3] + abs(f_row[col + 3])
        m3 = min(m3, q[col + 3])
        out_row[col + 3] = q[col + 3]
        e4 += max(q[col + 4] - f_row[col + 4], 0.0)
        b4 += q[col + 4] + abs(f_row[col + 4])
        m4 = min(m4, q[col + 4])
        out_row[col + 4] = q[col + 4]
        e5 += max(q[col + 5] - f_row[col + 5], 0.0)
        b5 += q[col + 5] + abs(f_row[col + 5])
        m5 = min(m5, q[col + 5])
        out_row[col + 5] = q[col + 5]
        e6 += max(q[col + 6] - f_row[col + 6], 0.0)
        b6 += q[col + 6] + abs(f_row[col + 6])
        m6 = min(m6, q[col + 6])
        out_row[col + 6] = q[col + 6]
        e7 += max(q[col + 7] - f_row[col + 7], 0.0)
        b7 += q[col + 7] + abs(f_row[col + 7])
        m7 = min(m7, q[col + 7])
        out_row[col + 7] = q[col + 7]
    for col in range(lanes, k):
        e0 += max(q[col] - f_row[col], 0.0)
        b0 += q[col] + abs(f_row[col])
        m0 = min(m0, q[col])
        out_row[col] = q[col]
    least = min(min(min(m0, m1), min(m2, m3)), min(min(m4, m5), min(m6, m7)))
    if least < floor:
        return False
    excess = ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7))
    bound = ((b0 + b1) + (b2 + b3)) + ((b4 + b5) + (b6 + b7))
    margin = 4.0 * k * UNIT_ROUNDOFF * bound + 2.0 * UNIT_ROUNDOFF * abs(half) + 1e-300
    if excess + margin < half:
        return True
    if excess - margin > half:
        return False
    return _reference_excess(f_row, q) <= half


@simd
def shield_rows(
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
    r"""SSD on rows ``start:stop`` of ``f``: budget, pseudo-label and projection.

    ``u`` is ``uniforms[row]`` when given, else the counter stream
    :func:`~.elementary.counter_uniform` at ``counter + row``. ``settings`` holds
    :math:`\varepsilon`, the constant budget (< 0: none, use
    :math:`\varepsilon H`), ``T`` (0: draw from ``f``) and the floor of ``q``.
    ``out`` (N or 0 rows) receives the answers, ``labels`` (N or 0 entries) the
    pseudo-labels.

    Returns
    -------
    ndarray of shape (3,)
        For the caller's input checks: the largest :math:`|\sum_i f_i - 1|` (NaN if
        a row holds NaN or inf), the row where it occurs, and -1.0 if any entry is
        negative (else 0.0). Rows that fail the checks hold meaningless output.
    """
    k = f.shape[1]
    epsilon = settings[0]
    constant = settings[1]
    temperature = settings[2]
    inverse = min(1.0 / temperature, INVERSE_CAP)
    floor = settings[3]
    rows = np.empty((3, k))
    row_f = rows[0]
    work = rows[1]
    spare = rows[2]
    bits = rows.view(np.int64)
    spare_bits = bits[2]
    scratch = np.empty((2, k))
    below = np.empty(k, dtype=np.int64)
    above = np.empty(k, dtype=np.int64)
    worst = 0.0
    worst_row = start
    negative = 0.0
    lanes = k - k % 4
    for row in range(start, stop):
        s0 = s1 = s2 = s3 = 0.0
        n0 = n1 = n2 = n3 = 0.0
        m0 = m1 = m2 = m3 = -np.inf
        for col in range(0, lanes, 4):
            a = np.float64(f[row, col])
            b = np.float64(f[row, col + 1])
            c = np.float64(f[row, col + 2])
            d = np.float64(f[row, col + 3])
            row_f[col] = a
            row_f[col + 1] = b
            row_f[col + 2] = c
            row_f[col + 3] = d
            s0 += a
            s1 += b
            s2 += c
            s3 += d
            n0 += np.float64(a < 0.0)
            n1 += np.float64(b < 0.0)
            n2 += np.float64(c < 0.0)
            n3 += np.float64(d < 0.0)
            m0 = max(m0, a)
            m1 = max(m1, b)
            m2 = max(m2, c)
            m3 = max(m3, d)
        for col in range(lanes, k):
            a = np.float64(f[row, col])
            row_f[col] = a
            s0 += a
            n0 += np.float64(a < 0.0)
            m0 = max(m0, a)
        total = (s0 + s1) + (s2 + s3)
        largest = max(max(m0, m1), max(m2, m3))
        if (n0 + n1) + (n2 + n3) > 0.0:
            negative = -1.0
        if not np.isfinite(total):
            if np.isfinite(worst):
                worst = np.nan
                worst_row = row
            continue
        if abs(total - 1.0) > worst:
            worst = abs(total - 1.0)
            worst_row = row
        log_row(row_f, work, spare, bits)
        h0 = h1 = h2 = h3 = 0.0
        for col in range(0, lanes, 4):
            h0 += row_f[col] * work[col]
            h1 += row_f[col + 1] * work[col + 1]
            h2 += row_f[col + 2] * work[col + 2]
            h3 += row_f[col + 3] * work[col + 3]
        for col in range(lanes, k):
            h0 += row_f[col] * work[col]
        entropy = -((h0 + h1) + (h2 + h3))
        if temperature > 0.0:
            for col in range(k):
                work[col] = (row_f[col] - largest) * inverse
            exp_row(work, work, spare, spare_bits)
        else:
            for col in range(k):
                work[col] = max(row_f[col], 0.0)
        w0 = w1 = w2 = w3 = 0.0
        for col in range(0, lanes, 4):
            w0 += work[col]
            w1 += work[col + 1]
            w2 += work[col + 2]
            w3 += work[col + 3]
        for col in range(lanes, k):
            w0 += work[col]
        u = (
            uniforms[row]
            if uniforms.shape[0]
            else counter_uniform(key, counter + np.uint64(row))
        )
        threshold = u * ((w0 + w1) + (w2 + w3))
        label = -1
        running = 0.0
        for col in range(k):
            running += work[col]
            if work[col] > 0.0:
                label = col
                if running > threshold:
                    break
        if label < 0:
            label = int(np.argmax(row_f))
        if labels.shape[0]:
            labels[row] = label
        if not out.shape[0]:
            continue
        half = 0.5 * (constant if constant >= 0.0 else epsilon * entropy)
        q = prototypes[label]
        if _written_if_trivial(row_f, q, floor, half, out[row]):
            continue
        project_row(row_f, q, floor, half, max_steps, scratch, below, above, out[row])
    result = np.empty(3)
    result[0] = worst
    result[1] = worst_row
    result[2] = negative
    return result
