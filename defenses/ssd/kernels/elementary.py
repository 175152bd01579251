r"""Elementary functions as row loops: ``log``, ``exp`` and a counter-based stream.

libm's scalar ``log`` and ``exp`` cost about 5-10 ns per entry and cannot be
vectorized (no vector math library is linked); these are written in plain
arithmetic and integer bit operations, so the compiler turns each loop into 4-wide
AVX2 code. Both are accurate to about one unit in the last place (tested against
numpy over the whole range they are used on):

* :math:`\ln x = e \ln 2 + \ln m`, where :math:`x = 2^e m`,
  :math:`m \in [\sqrt{1/2}, \sqrt 2)` (read from the float's bits), and
  :math:`\ln m = 2\,\mathrm{atanh}\,s`, :math:`s = (m - 1)/(m + 1)`, by fdlibm's
  ``__ieee754_log`` (Sun Microsystems, 1993): a degree-14 minimax polynomial in
  :math:`s` split in two short chains (error below 1 ulp);
* :math:`e^a = 2^{k/N} e^r` with :math:`N = 128`,
  :math:`k = \operatorname{round}(a N / \ln 2)`, :math:`r = a - k \ln 2 / N` in two
  parts (Cody and Waite; the high part has 32 significant bits, so :math:`k` times
  it is exact), :math:`|r| \le \ln 2 / 256`, and :math:`e^r = 1 + r + r^2 Q(r)`
  with a cubic :math:`Q`: the table form of glibc's ``exp`` (2.28, Szabolcs Nagy).
  :math:`2^{k/N} = 2^{\lfloor k/N \rfloor} 2^{j/N}`, :math:`j = k \bmod N`, is a
  table's double :math:`2^{j/N}(1 - \tau_j)` with its exponent raised by
  :math:`\lfloor k/N \rfloor` in the bits, and its relative tail :math:`\tau_j`;
  :math:`e^a = s + s\,(\tau_j + (r + r^2 Q(r)))`. No division (fdlibm's rational
  form :math:`1 + 2r / (2 - c(r))`, used before, divided once an entry) and a
  polynomial of degree 5 instead of 10: 1.31 against 1.40 ns an entry. Defined for
  :math:`a \le 0`; below :math:`-708` (where :math:`e^a` leaves the normal range)
  and for NaN the result is 0.

Bits are read and written through integer views of float scratch rows (numba has
no scalar bit cast), so each function is two or three short loops over one row.
"""

from __future__ import annotations

from decimal import Decimal, localcontext

import numpy as np

from defenses.arrays import FloatArray, IntArray
from defenses.ssd.kernels import simd_inlined

LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
SQRT2 = 1.4142135623730951
ROUNDING = 6755399441055744.0
"""1.5 * 2**52: added to an integer-valued float, it puts the integer in low bits."""
EXP_FLOOR = -708.0
INVERSE_CAP = 1e300
r"""The weights' factor :math:`s = \min(1/T, 10^{300})` (rounded :math:`1/T`): a
multiplication an entry instead of a division, 3-5 % of the K = 10 kernel; capped so
that :math:`0 \cdot s = 0` at the largest entry when :math:`1/T` overflows
(subnormal :math:`T`)."""
LG1 = 6.666666666666735130e-01
LG2 = 3.999999999940941908e-01
LG3 = 2.857142874366239149e-01
LG4 = 2.222219843214978396e-01
LG5 = 1.818357216161805012e-01
LG6 = 1.531383769920937332e-01
LG7 = 1.479819860511658591e-01
EXP_BITS = 7
"""``exp``'s table has :math:`N = 2^7` entries."""
INV_LN2_N = 184.6649652337873
r""":math:`N / \ln 2`."""
LN2_N_HI = 0.005415212348452769
r""":math:`\ln 2 / N` to 32 significant bits (:math:`k` times it is exact)."""
LN2_N_LO = -3.2819649005320973e-13
r""":math:`\ln 2 / N` minus :data:`LN2_N_HI`, to double precision."""
EXP_DEAD = -1.0e4
r"""Stands for an argument below :data:`EXP_FLOOR` (its :math:`k` is below
:data:`DEAD_K`, whose scale is 0)."""
DEAD_K = -140000
r"""Below every :math:`k` of an argument at or above :data:`EXP_FLOOR` (-130,743)."""
Q0 = 0.4999999999999903
Q1 = 0.16666666666666527
Q2 = 0.04166667705345528
Q3 = 0.00833333481716024
r"""``exp``'s :math:`Q(r) \approx (e^r - 1 - r) / r^2` on :math:`|r| \le \ln 2/256`.

A cubic Chebyshev fit (``mpmath.chebyfit`` at 50 digits, rounded to doubles): with
these doubles :math:`1 + r + r^2 Q(r)` is within :math:`7 \cdot 10^{-20}`
(0.0007 ulp) of :math:`e^r` relative, over 2001 points of the interval.
"""


def _exp_table() -> tuple[FloatArray, IntArray]:
    r"""The relative tails :math:`\tau_j` and the bits of :math:`2^{j/N}` less ``j``.

    :math:`2^{j/N}` is taken to 40 digits (``decimal``: the same digits on every
    machine), rounded to the double :math:`h_j`; :math:`\tau_j = (2^{j/N} - h_j) /
    h_j`. The bits are :math:`h_j`'s with :math:`j \cdot 2^{45}` subtracted, so that
    adding :math:`k \cdot 2^{45}` gives :math:`2^{\lfloor k/N \rfloor} h_j`.
    """
    n = 1 << EXP_BITS
    tails = np.empty(n)
    bits = np.empty(n, dtype=np.int64)
    with localcontext() as context:
        context.prec = 40
        for j in range(n):
            exact = Decimal(2) ** (Decimal(j) / n)
            high = float(exact)
            tails[j] = float((exact - Decimal(high)) / Decimal(high))
            word = int(np.array(high).view(np.int64))
            bits[j] = word - (j << (52 - EXP_BITS))
    return tails, bits


EXP_TAILS, EXP_SCALES = _exp_table()
EXP_MASK = (1 << EXP_BITS) - 1
EXP_SHIFT = 52 - EXP_BITS
r"""``k`` shifted by this many bits adds :math:`\lfloor k/N \rfloor` to the exponent
(and ``j`` to the mantissa, which the table's bits subtract)."""
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
"""The SplitMix64 increment (2^64 divided by the golden ratio, odd)."""


@simd_inlined
def log_row(x: FloatArray, out: FloatArray, spare: FloatArray, bits: IntArray) -> None:
    r"""``out = ln(x)`` for positive normal ``x`` (0 gives about -709).

    ``bits`` holds three integer views, of ``x``, ``out`` and the scratch row
    ``spare`` (made once by the caller: a view per row costs more than a short
    row's arithmetic); ``out`` must not be ``x``. Subnormal inputs give a log too
    large by up to 36, which in :math:`x \ln x` is below ``1e-305``. The reduction
    to :math:`[\sqrt{1/2}, \sqrt 2)` selects ``m / 2`` and ``e + 1`` rather than
    multiplying by a 0/1 float made from the comparison: that conversion compiled to
    a mask-to-vector sequence that made the loop 4.5x slower on the test machine
    (5.1 against 1.1 ns an entry at K = 1000).
    """
    k = x.shape[0]
    for j in range(k):
        b = bits[0, j]
        bits[1, j] = (b & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000
        bits[2, j] = ((b >> 52) & 0x7FF) | 0x4330000000000000
    for j in range(k):
        m = out[j]
        e = spare[j] - 4503599627371519.0
        big = m > SQRT2
        m = 0.5 * m if big else m
        e = e + 1.0 if big else e
        g = m - 1.0
        s = g / (2.0 + g)
        z = s * s
        w = z * z
        t1 = w * (LG2 + w * (LG4 + w * LG6))
        t2 = z * (LG1 + w * (LG3 + w * (LG5 + w * LG7)))
        half_square = 0.5 * g * g
        out[j] = e * LN2_HI - (
            (half_square - (s * (half_square + (t1 + t2)) + e * LN2_LO)) - g
        )


@simd_inlined
def exp_row(a: FloatArray, out: FloatArray, spare: FloatArray, scale: IntArray) -> None:
    """``out = exp(a)`` for ``a <= 0`` (0 below -708); ``out`` may be ``a``.

    ``scale`` is an integer view of the scratch row ``spare``. The second loop's
    table loads are gathers (4-wide on AVX2); every load comes before its select.
    """
    k = a.shape[0]
    for j in range(k):
        v = a[j]
        v = v if v >= EXP_FLOOR else EXP_DEAD
        n = v * INV_LN2_N + ROUNDING
        spare[j] = n
        n = n - ROUNDING
        r = (v - n * LN2_N_HI) - n * LN2_N_LO
        out[j] = r + (r * r) * (Q0 + r * (Q1 + r * (Q2 + r * Q3)))
    for j in range(k):
        n_bits = scale[j] - 0x4338000000000000
        entry = n_bits & EXP_MASK
        out[j] = EXP_TAILS[entry] + out[j]
        s = EXP_SCALES[entry] + (n_bits << EXP_SHIFT)
        scale[j] = s if n_bits >= DEAD_K else 0
    for j in range(k):
        out[j] = spare[j] + spare[j] * out[j]


@simd_inlined
def counter_uniform(key: np.uint64, index: np.uint64) -> float:
    """A uniform number in [0, 1): SplitMix64's output for ``key + index * GOLDEN``.

    A counter-based stream: the ``index``-th number depends on nothing else, so rows
    can be drawn in any order, block or thread and give the same numbers.
    """
    z = key + index * GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return float(z >> np.uint64(11)) * 2.0**-53
