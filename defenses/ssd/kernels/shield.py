r"""The whole SSD call as one compiled row loop (:func:`shield_rows`).

For each row the kernel reads ``f`` once into a float64 row scratch, which stays in
cache (K = 1000: 8 KiB) for the passes that follow, and writes the answer once in
the caller's dtype; nothing of size N K is allocated:

1. the row's sum, largest entry and count of negative entries (the input checks),
   in four interleaved accumulators (a fixed order, so the same bits every run);
2. the entropy :math:`H = -\sum_i f_i \ln f_i` (:func:`~.elementary.log_row`);
3. the pseudo-label: the first index whose running weight exceeds
   :math:`u \sum_i w_i`, with :math:`w_i = e^{(f_i - \max f) / T}`
   (:func:`~.elementary.exp_row`; the weights of
   :math:`\operatorname{softmax}(f / T)` up to a common factor) or
   :math:`w_i = f_i` for the ablation without temperature;
4. the projection towards ``prototypes[y]`` within :math:`\varepsilon H`: first the
   trivial case's test, :math:`\sum_i (q_i - f_i)_+ \le B / 2` (the answer is
   :math:`q_y`, no division), else :func:`~.projection.project_row`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.ssd.kernels import simd
from defenses.ssd.kernels.elementary import counter_uniform, exp_row, log_row
from defenses.ssd.kernels.projection import project_row


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
                work[col] = (row_f[col] - largest) / temperature
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
        below_f = 0.0
        below_q = 0.0
        raised = 0.0
        for col in range(k):
            qv = q[col]
            fv = row_f[col]
            inside = np.float64(fv < qv)
            below_f += fv * inside
            below_q += qv * inside
            raised += np.float64(qv < floor)
        if raised == 0.0 and below_q - below_f <= half:
            for col in range(k):
                out[row, col] = q[col]
            continue
        project_row(row_f, q, floor, half, max_steps, scratch, below, above, out[row])
    result = np.empty(3)
    result[0] = worst
    result[1] = worst_row
    result[2] = negative
    return result
