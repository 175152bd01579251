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
* :math:`e^a = 2^n e^r` with :math:`n = \operatorname{round}(a / \ln 2)`,
  :math:`r = a - n \ln 2` in two parts (Cody and Waite), :math:`|r| \le 0.347`, and
  fdlibm's ``__ieee754_exp`` rational form :math:`e^r = 1 + 2r / (2 - c(r))` with a
  degree-10 minimax :math:`c` (error below 1 ulp); :math:`2^n` is built in the
  exponent bits. Defined for :math:`a \le 0`; below :math:`-708` (where
  :math:`e^a` leaves the normal range) the result is 0.

Bits are read and written through integer views of float scratch rows (numba has
no scalar bit cast), so each function is two or three short loops over one row.
"""

from __future__ import annotations

import numpy as np

from defenses.arrays import FloatArray, IntArray
from defenses.ssd.kernels import simd_inlined

LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
LOG2E = 1.4426950408889634
SQRT2 = 1.4142135623730951
ROUNDING = 6755399441055744.0
"""1.5 * 2**52: added to an integer-valued float, it puts the integer in low bits."""
EXP_FLOOR = -708.0
LG1 = 6.666666666666735130e-01
LG2 = 3.999999999940941908e-01
LG3 = 2.857142874366239149e-01
LG4 = 2.222219843214978396e-01
LG5 = 1.818357216161805012e-01
LG6 = 1.531383769920937332e-01
LG7 = 1.479819860511658591e-01
P1 = 1.66666666666666019037e-01
P2 = -2.77777777770155933842e-03
P3 = 6.61375632143793436117e-05
P4 = -1.65339022054652515390e-06
P5 = 4.13813679705723846039e-08
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

    ``scale`` is an integer view of the scratch row ``spare``.
    """
    k = a.shape[0]
    for j in range(k):
        v = a[j]
        inside = v >= EXP_FLOOR
        v = max(v, EXP_FLOOR)
        n = np.floor(v * LOG2E + 0.5)
        high = v - n * LN2_HI
        low = n * LN2_LO
        r = high - low
        t = r * r
        c = r - t * (P1 + t * (P2 + t * (P3 + t * (P4 + t * P5))))
        p = 1.0 - ((low - (r * c) / (2.0 - c)) - high)
        out[j] = p if inside else 0.0
        spare[j] = n + ROUNDING
    for j in range(k):
        scale[j] = ((scale[j] - 0x4338000000000000) + 1023) << 52
    for j in range(k):
        out[j] = out[j] * spare[j]


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
