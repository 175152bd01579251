r"""SSD's kernels in plain numpy, bit for bit: the answer while a kernel compiles.

A compiled kernel's first call on a machine with no cached machine code waits for
the compiler (20-40 s for the shield's kernels on an idle 2-core machine). Until a
background process has filled the cache (:mod:`.background`), calls run these
functions instead. Each takes the kernel's arguments and returns what the kernel
returns, with the same bits, because it performs the same IEEE operations in the
same order, only with the rows as numpy's vector lanes (as
:func:`~.small.shield_rows_small` makes them SIMD lanes):

* a sum the kernel accumulates in a fixed order (one accumulator, or four by column
  modulo 4 with the last ``K % 4`` columns in the first) is an ordered running sum
  here too (:func:`_ordered`: ``np.add.accumulate``, never ``np.sum``, whose
  pairwise order differs), started at ``0.0`` as the kernel's is;
* a masked term adds an exact ``+0.0``, so the Newton steps' sums over active sets
  are the kernel's sums over its compacted index lists;
* ``max(a, b)`` and ``min(a, b)`` are numba's (``b if b > a else a``), not
  ``np.maximum`` (which differs on NaN and on the sign of zero);
* ``ln`` and ``exp`` are :mod:`.elementary`'s polynomials and tables, term by term;
* a row whose Newton iteration does not end within ``max_steps`` steps (possible
  only for K above it) sorts its survivors with numba's own quicksort
  (``make_py_quicksort``), so ties in the ratios are walked in the kernel's order.

Tests compare every function with its kernel on random and edge inputs
(``tests/defenses/ssd/test_plain.py``). Speed: a few times the kernel's at K = 10.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.ssd.kernels.elementary import (
    DEAD_K,
    EXP_DEAD,
    EXP_FLOOR,
    EXP_MASK,
    EXP_SCALES,
    EXP_SHIFT,
    EXP_TAILS,
    GOLDEN,
    INV_LN2_N,
    INVERSE_CAP,
    LG1,
    LG2,
    LG3,
    LG4,
    LG5,
    LG6,
    LG7,
    LN2_HI,
    LN2_LO,
    LN2_N_HI,
    LN2_N_LO,
    Q0,
    Q1,
    Q2,
    Q3,
    ROUNDING,
    SQRT2,
)

CHUNK_ENTRIES = 1 << 16
"""Entries (rows x K) processed at once: temporaries stay a few MB at any N."""


def _nmax(a: Any, b: Any) -> Any:
    """Numba's ``max(a, b)`` for floats: ``b if b > a else a``, elementwise."""
    return np.where(b > a, b, a)


def _nmin(a: Any, b: Any) -> Any:
    """Numba's ``min(a, b)`` for floats: ``b if b < a else a``, elementwise."""
    return np.where(b < a, b, a)


def _ordered(columns: FloatArray) -> FloatArray:
    """Row sums added left to right from ``0.0`` (one accumulator, the kernels')."""
    rows = columns.shape[0]
    padded = np.concatenate([np.zeros((rows, 1)), columns], axis=1)
    total: FloatArray = np.add.accumulate(padded, axis=1)[:, -1]
    return total


def _four(values: FloatArray) -> FloatArray:
    """Row sums in four accumulators by column modulo 4, combined as the kernels do.

    The last ``K % 4`` columns go to the first accumulator after its own columns;
    the total is ``(a0 + a1) + (a2 + a3)``.
    """
    k = values.shape[1]
    lanes = k - k % 4
    first = np.concatenate([np.arange(0, lanes, 4), np.arange(lanes, k)])
    a0 = _ordered(values[:, first])
    a1 = _ordered(values[:, 1:lanes:4])
    a2 = _ordered(values[:, 2:lanes:4])
    a3 = _ordered(values[:, 3:lanes:4])
    total: FloatArray = (a0 + a1) + (a2 + a3)
    return total


def log_rows(x: FloatArray) -> FloatArray:
    """:func:`~.elementary.log_row`, elementwise on a float64 array."""
    b = np.ascontiguousarray(x, dtype=np.float64).view(np.int64)
    m = ((b & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000).view(np.float64)
    e = (((b >> 52) & 0x7FF) | 0x4330000000000000).view(np.float64)
    e = e - 4503599627371519.0
    big = m > SQRT2
    m = np.where(big, 0.5 * m, m)
    e = np.where(big, e + 1.0, e)
    g = m - 1.0
    s = g / (2.0 + g)
    z = s * s
    w = z * z
    t1 = w * (LG2 + w * (LG4 + w * LG6))
    t2 = z * (LG1 + w * (LG3 + w * (LG5 + w * LG7)))
    half_square = 0.5 * g * g
    out: FloatArray = e * LN2_HI - (
        (half_square - (s * (half_square + (t1 + t2)) + e * LN2_LO)) - g
    )
    return out


def exp_rows(a: FloatArray) -> FloatArray:
    """:func:`~.elementary.exp_row`, elementwise on a float64 array (``a <= 0``)."""
    v = np.where(a >= EXP_FLOOR, a, EXP_DEAD)
    n = np.ascontiguousarray(v * INV_LN2_N + ROUNDING)
    n_bits = n.view(np.int64) - 0x4338000000000000
    n = n - ROUNDING
    r = (v - n * LN2_N_HI) - n * LN2_N_LO
    part = r + (r * r) * (Q0 + r * (Q1 + r * (Q2 + r * Q3)))
    entry = n_bits & EXP_MASK
    part = EXP_TAILS[entry] + part
    bits = EXP_SCALES[entry] + (n_bits << EXP_SHIFT)
    scale = np.where(n_bits >= DEAD_K, bits, 0).view(np.float64)
    out: FloatArray = scale + scale * part
    return out


def counter_uniforms(key: np.uint64, index: npt.NDArray[np.uint64]) -> FloatArray:
    """:func:`~.elementary.counter_uniform` at every ``index`` (uint64 arithmetic)."""
    z = np.uint64(key) + index * GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    out: FloatArray = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return out


_SORT: Any = None


def _argsort(values: FloatArray) -> IntArray:
    """Numba's ``np.argsort`` (its quicksort, NaN last), run by the interpreter."""
    global _SORT
    if _SORT is None:
        quicksort: Any = importlib.import_module("numba.misc.quicksort")
        arrays: Any = importlib.import_module("numba.np.arrayobj")
        _SORT = quicksort.make_py_quicksort(
            lt=arrays.lt_floats, is_argsort=True, is_np_array=True
        )
    order: IntArray = np.asarray(_SORT.run_quicksort(values), dtype=np.int64)
    return order


def _walk(
    ratio: FloatArray,
    f: FloatArray,
    q: FloatArray,
    alive: IntArray,
    h: float,
    raising: bool,
) -> float:
    """:func:`~.projection._walk` for one row (Python floats are IEEE doubles)."""
    order = alive[_argsort(ratio[alive].copy())]
    if not raising:
        order = order[::-1]
    sum_f = 0.0
    sum_q = 0.0
    last = order.shape[0] - 1
    for j in range(last + 1):
        col = int(order[j])
        sum_f += float(f[col])
        sum_q += float(q[col])
        if j == last:
            break
        step = float(ratio[order[j + 1]]) * sum_q
        if (step - sum_f if raising else sum_f - step) > h:
            break
    sign = 1.0 if raising else -1.0
    return (sum_f + sign * h) / sum_q


def _level(
    ratio: FloatArray,
    f: FloatArray,
    q: FloatArray,
    alive: npt.NDArray[np.bool_],
    h: FloatArray,
    raising: bool,
    max_steps: int,
) -> FloatArray:
    """:func:`~.projection._level` for every row, active sets as masks."""
    sign = 1.0 if raising else -1.0
    count = alive.sum(axis=1)
    sum_f = _ordered(f * alive)
    sum_q = _ordered(q * alive)
    level = np.full(f.shape[0], 0.0 if raising else np.inf)
    going = count > 0
    for _ in range(max_steps):
        if not going.any():
            return level
        trial = (sum_f + sign * h) / sum_q
        keep = alive & (sign * (ratio - trial[:, None]) < 0.0)
        kept = keep.sum(axis=1)
        ends = going & ((kept == count) | (kept == 0))
        level[ends] = trial[ends]
        going &= ~ends
        alive = np.where(going[:, None], keep, alive)
        count = np.where(going, kept, count)
        sum_f = np.where(going, _ordered(f * keep), sum_f)
        sum_q = np.where(going, _ordered(q * keep), sum_q)
    for row in np.flatnonzero(going):
        survivors = np.flatnonzero(alive[row]).astype(np.int64)
        level[row] = _walk(ratio[row], f[row], q[row], survivors, h[row], raising)
    return level


def project(
    f: FloatArray, q: FloatArray, floor: float, h: FloatArray, max_steps: int
) -> FloatArray:
    """:func:`~.projection.project_row`'s answer for every row (float64)."""
    with np.errstate(all="ignore"):
        raised = (q < floor).any(axis=1)
        floored = _nmax(q, floor)
        mass = np.where(raised, _ordered(floored), 1.0)
        ratio = f / floored
        start = 1.0 / mass
        lower = ratio < start[:, None]
        upper = ratio > start[:, None]
        early = start * _ordered(floored * lower) - _ordered(f * lower) <= h
        out: FloatArray = floored * start[:, None]
        rest = np.flatnonzero(~early)
        if rest.size:
            r, fr, qr, hr = ratio[rest], f[rest], floored[rest], h[rest]
            w_a = _level(r, fr, qr, lower[rest], hr, True, max_steps)
            w_b = _level(r, fr, qr, upper[rest], hr, False, max_steps)
            out[rest] = _nmin(_nmax(fr, w_a[:, None] * qr), w_b[:, None] * qr)
    return out


def project_rows(
    f: FloatArray,
    q: FloatArray,
    floor: float,
    half: FloatArray,
    max_steps: int,
    stats: FloatArray,
    out: FloatArray,
) -> None:
    """:func:`~.projection.project_rows`: the same answers and statistics."""
    n, k = f.shape
    step = max(1, CHUNK_ENTRIES // max(k, 1))
    with np.errstate(all="ignore"):
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            fs, qs = np.asarray(f[lo:hi], np.float64), np.asarray(q[lo:hi], np.float64)
            stats[lo:hi, 0] = _ordered(fs)
            stats[lo:hi, 1] = _ordered(qs)
            stats[lo:hi, 2] = np.fmin.reduce(fs, axis=1, initial=np.inf)
            stats[lo:hi, 3] = np.fmin.reduce(qs, axis=1, initial=np.inf)
            out[lo:hi] = project(fs, qs, floor, np.asarray(half[lo:hi]), max_steps)


def _checks(
    x: FloatArray, lo: int, worst: float, worst_row: int
) -> tuple[npt.NDArray[np.bool_], float, int]:
    """The rows' input checks folded into ``worst`` as the row kernel folds them."""
    total = _four(x)
    finite = np.isfinite(total)
    end = int(np.argmin(finite)) if not finite.all() else x.shape[0]
    if np.isfinite(worst) and end > 0:
        deviation = np.abs(total[:end] - 1.0)
        j = int(np.argmax(deviation))
        if deviation[j] > worst:
            worst, worst_row = float(deviation[j]), lo + j
    if np.isfinite(worst) and end < x.shape[0]:
        worst, worst_row = np.nan, lo + end
    return finite, worst, worst_row


def _draw(work: FloatArray, threshold: FloatArray, x: FloatArray) -> IntArray:
    """The first column of positive weight whose running weight passes the threshold.

    Else the last column of positive weight, else the arg-max of ``x``: the row
    kernel's loop, which adds the weights left to right and stops there. Its running
    sums are ``np.add.accumulate``'s (only compared, so the sign of a zero sum,
    ``0.0 + -0.0`` there and ``-0.0`` here, does not matter).
    """
    positive = work > 0.0
    passed = positive & (np.add.accumulate(work, axis=1) > threshold[:, None])
    k = x.shape[1]
    label: IntArray = np.where(
        passed.any(axis=1),
        np.argmax(passed, axis=1),
        k - 1 - np.argmax(positive[:, ::-1], axis=1),
    ).astype(np.int64)
    none = ~positive.any(axis=1)
    label[none] = np.argmax(x[none], axis=1)
    return label


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
    """:func:`~.shield.shield_rows` (and :func:`~.small.shield_rows_small`) in numpy.

    Same arguments, answers, labels and returned statistics.
    """
    k = f.shape[1]
    epsilon, constant, temperature, floor = (float(v) for v in settings[:4])
    worst, worst_row, negative = 0.0, start, 0.0
    step = max(1, CHUNK_ENTRIES // max(k, 1))
    with np.errstate(all="ignore"):
        for lo in range(start, stop, step):
            hi = min(lo + step, stop)
            x = np.asarray(f[lo:hi], dtype=np.float64)
            if (x < 0.0).any():
                negative = -1.0
            finite, worst, worst_row = _checks(x, lo, worst, worst_row)
            rows = np.flatnonzero(finite)
            x = x[rows]
            entropy = -_four(x * log_rows(x))
            if temperature > 0.0:
                largest = x.max(axis=1, initial=-np.inf)
                inverse = _nmin(np.float64(1.0) / np.float64(temperature), INVERSE_CAP)
                work = exp_rows((x - largest[:, None]) * inverse)
            else:
                work = np.where(x < 0.0, 0.0, x)
            if uniforms.shape[0]:
                u = uniforms[lo + rows]
            else:
                index = np.uint64(counter) + (lo + rows).astype(np.uint64)
                u = counter_uniforms(key, index)
            label = _draw(work, u * _four(work), x)
            if labels.shape[0]:
                labels[lo + rows] = label
            if not out.shape[0]:
                continue
            scale = np.full(rows.shape[0], constant) if constant >= 0.0 else None
            half = 0.5 * (scale if scale is not None else epsilon * entropy)
            q = prototypes[label]
            inside = (x < q).astype(np.float64)
            excess = _ordered(q * inside) - _ordered(x * inside)
            trivial = ~(q < floor).any(axis=1) & (excess <= half)
            answer = q.copy()
            rest = np.flatnonzero(~trivial)
            answer[rest] = project(x[rest], q[rest], floor, half[rest], max_steps)
            out[lo + rows] = answer
    return np.array([worst, float(worst_row), negative])


def blake2b_rows(
    words: npt.NDArray[np.uint64], length: int, key: np.uint64, iv: Any
) -> FloatArray:
    """:func:`~.blake2b.blake2b_rows` through :mod:`hashlib` (the same digests)."""
    import hashlib

    del iv
    secret = np.uint64(key).tobytes()
    message = np.ascontiguousarray(words).view(np.uint8)[:, :length]
    out = np.empty(words.shape[0])
    for row in range(words.shape[0]):
        digest = hashlib.blake2b(message[row].tobytes(), key=secret, digest_size=8)
        out[row] = (int.from_bytes(digest.digest(), "little") >> 11) * 2.0**-53
    return out
