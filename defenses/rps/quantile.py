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
"""

from __future__ import annotations

import functools
import math
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt
from scipy import special, stats

from defenses.checks import check_int, check_real

QuantileMode = Literal["exact", "official", "markov"]
QUANTILE_MODES: tuple[str, ...] = get_args(QuantileMode)

_PANELS = 64
_NODES = 16


def check_alpha(alpha: float) -> float:
    """Return ``alpha`` as a float in (0, 1), or raise ValueError."""
    return check_real("alpha", alpha, 0.0, 1.0, open_low=True, open_high=True)


@functools.cache
def majority_threshold(n_parts: int, alpha: float) -> int:
    r"""The majority threshold :math:`\hat\tau(\alpha, k_c)`.

    A tolerance of 1e-12 keeps the edge case :math:`k_c = 1` (where
    :math:`F(0) = \alpha` exactly) from falling out through rounding.
    """
    a = check_alpha(alpha)
    check_int("n_parts", n_parts, 1)
    cdf = stats.binom.cdf(np.arange(n_parts + 1), n_parts, 1.0 - a)
    return int(np.flatnonzero(cdf <= a + 1e-12).max())


def textbook_rank(n: int, alpha: float) -> int:
    r"""The split-conformal rank :math:`\min(\lfloor (n + 1)\alpha \rfloor, n)`.

    The cap matters only when :math:`\alpha > n / (n + 1)` (a confidence level
    below :math:`1 / (n + 1)`): the largest score is then the threshold.
    """
    return min(math.floor((n + 1) * alpha + 1e-9), n)


def official_rank(n: int, alpha: float) -> int:
    """The official code's rank (``np.quantile(..., method="lower")``), 1-based."""
    q_level = math.floor((n + 1) * alpha - 1) / n
    if q_level < 0:
        return 0
    return min(math.floor(q_level * (n - 1)) + 1, n)


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
    """Largest rank with exact majority miscoverage <= alpha (parts of size n)."""
    tau = majority_threshold(n_parts, alpha)
    rank = textbook_rank(n, alpha)
    while rank > 0 and _homogeneous_miss(rank, n, n_parts, tau) > alpha:
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
        return textbook_rank(n, alpha * (n_parts - tau) / n_parts)
    raise ValueError(f"quantile mode must be one of {QUANTILE_MODES}, got {mode!r}")


@functools.cache
def minimum_part_size(alpha: float, n_parts: int, mode: QuantileMode) -> int:
    """Smallest part size whose rank is at least 1 under ``mode``."""
    n = 1
    while part_rank(n, alpha, n_parts, mode) < 1:
        n += 1
    return n
