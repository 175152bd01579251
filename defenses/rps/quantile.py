r"""Per-part conformal ranks and the majority threshold of RPS.

Scores are *conformity* scores (higher is more plausible) and a part's set is
:math:`C_i(x) = \{y : s(x, y) \ge \tau_i\}` with :math:`\tau_i` the
:math:`j_i`-th smallest of the part's :math:`n_i` calibration scores. A class enters
the majority set when it is in more than :math:`\hat\tau` part sets, with

.. math::

    \hat\tau(\alpha, k_c) = \max\{t \in \{0..k_c\} :
        F_{\mathrm{Bin}}(t; k_c, 1-\alpha) \le \alpha\}

(Scholten & Günnemann, ICLR 2025, Alg. 2). Three rank rules (``QuantileMode``):

``"exact"`` (default)
    The binomial rule assumes the part events are independent, but they share the
    test point and are positively correlated, so the textbook rank under-covers.
    With :math:`u = F(s(x_{n+1}, y_{n+1}))` uniform, part :math:`i` covers with
    probability :math:`G_i(u) = \mathrm{BetaCDF}(u; j_i, n_i + 1 - j_i)`, and the
    majority set misses with probability

    .. math::

        \mathrm{miss} = \int_0^1 P\big(\mathrm{PoissonBinomial}(G_1(u), \dots,
            G_{k_c}(u)) \le \hat\tau\big)\,du .

    Each part takes the largest rank :math:`j \le \lfloor (n_i + 1)\alpha \rfloor`
    whose miss for :math:`k_c` parts of its own size :math:`n_i` is at most
    :math:`\alpha`. The rank of a part depends on its own size only, so a poisoned
    calibration point still changes one part's set at most. The miss of the
    realised (unequal) sizes is reported by :func:`majority_miscoverage`.
``"official"``
    The official code's rank ``floor(q (n - 1)) + 1`` with
    ``q = floor((n + 1) alpha - 1) / n``: one rank below the textbook one.
``"markov"``
    The textbook rank at level :math:`\alpha' = \alpha (k_c - \hat\tau) / k_c`; by
    Markov's inequality the majority set covers with probability at least
    :math:`1 - \alpha` with no assumption on the dependence of the parts.

Scores are assumed continuous; ties only make every rule more conservative.

Every rank is computed exactly. The level is the decimal the user wrote: for a
float ``alpha``, :func:`exact_alpha` is one minus the shortest decimal that rounds
to the float ``1 - alpha`` (the ``confidence_level``), so ``confidence_level=0.9``
means :math:`\alpha = 1/10` exactly, although ``1 - 0.9`` is
``0.09999999999999998`` in binary floating point. Ranks such as
:math:`\lfloor (n + 1)\alpha \rfloor` and the binomial rule of :math:`\hat\tau`
then use integer and fraction arithmetic: at levels where :math:`(n + 1)\alpha`
is a whole number the rank is that number, never one below (a floating-point
product ``1.9999999999999996`` once gave rank 1 for ``n = 19``). The one
comparison computed by quadrature (the ``"exact"`` rule's miscoverage with
:math:`k_c > 1` parts) keeps a rank only when its miscoverage is at most
:math:`\alpha - ` :data:`QUADRATURE_MARGIN`, a margin that can only lower a rank
(larger sets); with one part the miscoverage is :math:`j / (n + 1)` and the rank
is the textbook one, exactly.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt
from scipy import special, stats

from defenses.checks import check_int, check_real

QuantileMode = Literal["exact", "official", "markov"]
QUANTILE_MODES: tuple[str, ...] = get_args(QuantileMode)

_PANELS = 64
_NODES = 16

QUADRATURE_MARGIN = 1e-9
"""The ``"exact"`` rule keeps a rank only if its quadrature miscoverage is at most
``alpha - QUADRATURE_MARGIN`` (the quadrature's error is below 1e-12 on the tested
grid, ``tests/defenses/rps/test_quantile.py``): the margin can only lower a rank."""


def check_alpha(alpha: float) -> float:
    """Return ``alpha`` as a float in (0, 1), or raise ValueError."""
    return check_real("alpha", alpha, 0.0, 1.0, open_low=True, open_high=True)


@functools.cache
def exact_alpha(alpha: float) -> Fraction:
    r"""The miscoverage level as an exact fraction: the level the user wrote.

    One minus the shortest decimal that rounds to the float ``1 - alpha`` (the
    ``confidence_level``): ``exact_alpha(1 - 0.9) == Fraction(1, 10)``. A decimal
    of more than 15 significant digits is the rounding noise of ``1 - (1 -
    level)`` (``confidence_level=0.1`` gives ``1 - 0.9 = 0.09999999999999998``)
    and is rounded to 15. If the result is 0 or 1 (``alpha`` below the float
    spacing near 1), the float ``alpha`` itself, exactly.
    """
    a = check_alpha(alpha)
    text = repr(1.0 - a)
    digits = text.lower().split("e")[0].replace("-", "").replace(".", "").strip("0")
    if len(digits) > 15:  # the noise of 1 - (1 - level), e.g. 0.09999999999999998
        text = f"{1.0 - a:.15g}"
    exact = 1 - Fraction(text)
    if not 0 < exact < 1:
        return Fraction(a)
    return exact


@functools.cache
def majority_threshold(n_parts: int, alpha: float) -> int:
    r"""The majority threshold :math:`\hat\tau(\alpha, k_c)`, computed exactly.

    :math:`F_{\mathrm{Bin}}(t; k_c, 1 - \alpha) \le \alpha` is decided in integer
    arithmetic with :math:`\alpha = p / q` (:func:`exact_alpha`):
    :math:`\sum_{i \le t} \binom{k_c}{i} (q - p)^i p^{k_c - i} \le p\, q^{k_c - 1}`.
    At :math:`k_c = 1`, :math:`F(0) = \alpha` exactly and :math:`\hat\tau = 0`.
    """
    a = exact_alpha(alpha)
    check_int("n_parts", n_parts, 1)
    p, q = a.numerator, a.denominator
    bound = p * q ** (n_parts - 1)
    total = 0
    tau = -1
    for t in range(n_parts + 1):
        total += math.comb(n_parts, t) * (q - p) ** t * p ** (n_parts - t)
        if total > bound:
            break
        tau = t
    if tau < 0:  # pragma: no cover - F(0) = alpha^k_c <= alpha always holds
        raise AssertionError("no majority threshold")
    return tau


def _rank_at(n: int, alpha: Fraction) -> int:
    """``min(floor((n + 1) alpha), n)`` in exact arithmetic."""
    return min(math.floor((n + 1) * alpha), n)


def textbook_rank(n: int, alpha: float) -> int:
    r"""The split-conformal rank :math:`\min(\lfloor (n + 1)\alpha \rfloor, n)`.

    Exact (:func:`exact_alpha`): at ``n = 19`` and ``confidence_level = 0.9`` the
    rank is 2. The cap matters only when :math:`\alpha > n / (n + 1)` (a
    confidence level below :math:`1 / (n + 1)`): the largest score is then the
    threshold.
    """
    return _rank_at(n, exact_alpha(alpha))


def official_rank(n: int, alpha: float) -> int:
    """The official code's rank (``np.quantile(..., method="lower")``), 1-based.

    ``floor(q (n - 1)) + 1`` with ``q = (floor((n + 1) alpha) - 1) / n``, exactly.
    """
    numerator = math.floor((n + 1) * exact_alpha(alpha)) - 1
    if numerator < 0:
        return 0
    return min(math.floor(Fraction(numerator * (n - 1), n)) + 1, n)


@functools.cache
def _nodes() -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    x, w = np.polynomial.legendre.leggauss(_NODES)
    edges = np.linspace(0.0, 1.0, _PANELS + 1)
    half = np.diff(edges) / 2
    mid = (edges[:-1] + edges[1:]) / 2
    u = (mid[:, None] + half[:, None] * x[None, :]).ravel()
    weights = (half[:, None] * w[None, :]).ravel()
    return u, weights


def _cover_probability(
    u: npt.NDArray[np.float64], rank: int, n: int
) -> npt.NDArray[np.float64]:
    if rank <= 0:
        return np.ones_like(u)
    return np.asarray(special.betainc(rank, n + 1 - rank, u), dtype=np.float64)


def majority_miscoverage(
    ranks: npt.ArrayLike, sizes: npt.ArrayLike, alpha: float
) -> float:
    """Exact miscoverage of the majority set for parts of given ranks and sizes.

    Integrates the Poisson-binomial CDF at ``tau_hat`` over the test point's score
    quantile ``u`` (composite Gauss-Legendre, 64 panels x 16 nodes).
    """
    j = np.asarray(ranks, dtype=np.int64)
    n = np.asarray(sizes, dtype=np.int64)
    if j.shape != n.shape or j.ndim != 1 or j.size == 0:
        raise ValueError(
            f"ranks and sizes must be 1-D of one length, got {j.shape}, {n.shape}"
        )
    pairs = tuple(sorted(zip(j.tolist(), n.tolist(), strict=True)))
    return _miscoverage(pairs, float(alpha))


@functools.lru_cache(maxsize=4096)
def _miscoverage(pairs: tuple[tuple[int, int], ...], alpha: float) -> float:
    j = np.array([p[0] for p in pairs], dtype=np.int64)
    n = np.array([p[1] for p in pairs], dtype=np.int64)
    tau = majority_threshold(int(j.size), alpha)
    u, weights = _nodes()
    dist = np.zeros((tau + 2, u.size))
    dist[0] = 1.0
    for rank, size in zip(j.tolist(), n.tolist(), strict=True):
        p = _cover_probability(u, rank, size)
        shifted = np.vstack([np.zeros((1, u.size)), dist[:-1]])
        dist = dist * (1.0 - p) + shifted * p
    miss = dist[: tau + 1].sum(axis=0)
    return float(np.dot(weights, miss))


@functools.cache
def _homogeneous_miss(rank: int, n: int, n_parts: int, tau: int) -> float:
    u, weights = _nodes()
    p = _cover_probability(u, rank, n)
    return float(np.dot(weights, stats.binom.cdf(tau, n_parts, p)))


@functools.cache
def exact_rank(n: int, alpha: float, n_parts: int) -> int:
    """Largest rank with exact majority miscoverage <= alpha (parts of size n).

    One part: the miscoverage of rank j is j / (n + 1), so the rank is the textbook
    one, in exact arithmetic. Several: the quadrature's miscoverage must be at most
    ``alpha - QUADRATURE_MARGIN`` (the margin only lowers a rank).
    """
    rank = textbook_rank(n, alpha)
    if n_parts == 1:
        return rank
    tau = majority_threshold(n_parts, alpha)
    limit = float(exact_alpha(alpha)) - QUADRATURE_MARGIN
    while rank > 0 and _homogeneous_miss(rank, n, n_parts, tau) > limit:
        rank -= 1
    return rank


def part_rank(n: int, alpha: float, n_parts: int, mode: QuantileMode) -> int:
    """The 1-based rank of a part of ``n`` calibration scores (0: no valid rank)."""
    if mode == "exact":
        return exact_rank(n, alpha, n_parts)
    if mode == "official":
        return official_rank(n, alpha)
    if mode == "markov":
        tau = majority_threshold(n_parts, alpha)
        return _rank_at(n, exact_alpha(alpha) * (n_parts - tau) / n_parts)
    raise ValueError(f"quantile mode must be one of {QUANTILE_MODES}, got {mode!r}")


@functools.cache
def minimum_part_size(alpha: float, n_parts: int, mode: QuantileMode) -> int:
    """Smallest part size whose rank is at least 1 under ``mode``."""
    n = 1
    while part_rank(n, alpha, n_parts, mode) < 1:
        n += 1
    return n
