"""Slice orders and the deletion-rate theory of S3T.

Chowdhury et al. (ICLR 2025) train ``B`` slice orders per shard so that a shard
survives until every order has lost its first slice.

* **Cyclic rotation** (their Algorithm 1, for uniform deletion priors). An order is
  indexed by rotation amounts ``(r_0, ..., r_{L-2})``, ``r_k < L - k``: start from
  ``(0, ..., L-1)`` and rotate the suffix from position ``k`` right by ``r_k``. Orders
  are listed breadth first (all ``r_0`` with deeper rotations zero, then ``r_1 = 1``
  for every ``r_0``, ...), so the first ``L`` form a Latin square and every budget
  ``B`` has ``B' = min(B, L)`` distinct first slices. (The official code interleaves
  the levels instead; for ``B`` a multiple of ``L`` both give the same set.)
* **BMS** (bipartite-matching selection, their Algorithm 2, for known per-slice
  deletion probabilities ``p``). Orders grow one position at a time; at each position
  a maximum-weight assignment matches orders to distinct unused slices, with weight
  the score of the extended prefix (when ``B < L`` leaves two orders only one and the
  same unused slice, both take it). We use a well-conditioned score, the expected
  surviving prefix length after ``t`` deletions hit the shard,
  ``score(pi) = sum_k (1 - c_k)^t`` with ``c_k = p_{pi_1} + ... + p_{pi_k}`` (the
  released code's ``t = 100`` makes every score vanish, so ties decide).
* **Deletion rate.** With deletions uniform over the ``m L`` slices, the system dies
  when all ``m B'`` first slices have been hit: a coupon collector on a fixed subset,
  ``E[delta] = m L H_{m B'}`` (``H`` the harmonic number); SISA with slice
  checkpoints is ``B = 1``: ``m L H_m``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from scipy import integrate
from scipy.optimize import linear_sum_assignment

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_int

Order = tuple[int, ...]


def _check_budget(slices: int, budget: int) -> None:
    check_int("slices", slices, minimum=1)
    check_int("sequences", budget, minimum=1)


def _rotate_right(items: list[int], r: int) -> list[int]:
    return items[len(items) - r :] + items[: len(items) - r] if r else items


def cyclic_orders(slices: int, budget: int) -> list[Order]:
    """The first ``budget`` orders of the breadth-first cyclic permutation tree.

    >>> cyclic_orders(4, 4)
    [(0, 1, 2, 3), (3, 0, 1, 2), (2, 3, 0, 1), (1, 2, 3, 0)]
    """
    _check_budget(slices, budget)
    if budget > math.factorial(slices):
        raise ValueError(
            f"sequences={budget} exceeds the {math.factorial(slices)} orders of "
            f"{slices} slices"
        )
    depth = max(slices - 1, 1)
    digits = [range(slices - k) for k in reversed(range(depth))]
    orders: list[Order] = []
    for reversed_rotations in itertools.islice(itertools.product(*digits), budget):
        sequence = list(range(slices))
        for k, r in enumerate(reversed(reversed_rotations)):
            sequence[k:] = _rotate_right(sequence[k:], r)
        orders.append(tuple(sequence))
    return orders


def prefix_score(prefix: Sequence[int], probs: FloatArray, horizon: float) -> float:
    """Expected surviving prefix length: ``sum_k (1 - c_k)^horizon``."""
    cumulative = np.cumsum(probs[list(prefix)])
    return float(np.sum(np.clip(1.0 - cumulative, 0.0, 1.0) ** horizon))


def bms_orders(
    probs: npt.ArrayLike, budget: int, horizon: float | None = None
) -> list[Order]:
    """Bipartite-matching selection of ``budget <= L`` orders for priors ``probs``.

    Parameters
    ----------
    probs : array of shape (L,)
        Per-slice deletion probabilities (non-negative; normalized here).
    budget : int
        Number of orders, at most ``L`` (beyond that the matching repeats itself).
    horizon : float or None
        ``t`` in the score, the number of deletions expected to hit the shard;
        ``L`` if None.
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or p.size == 0 or not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError(
            f"probs must be a non-empty 1-D array of finite values >= 0, got {p}"
        )
    if p.sum() <= 0:
        raise ValueError("probs must not all be zero")
    p = p / p.sum()
    slices = int(p.size)
    _check_budget(slices, budget)
    if budget > slices:
        raise ValueError(
            f"bms selects at most slices={slices} orders, got sequences={budget}; "
            "use selection='cyclic' for larger budgets"
        )
    t = float(slices) if horizon is None else float(horizon)
    if not t > 0:
        raise ValueError(f"horizon must be > 0, got {horizon!r}")
    orders: list[list[int]] = [[] for _ in range(budget)]
    for _ in range(slices):
        weights = np.full((budget, slices), -1e9)
        for row, prefix in enumerate(orders):
            for j in range(slices):
                if j not in prefix:
                    weights[row, j] = prefix_score([*prefix, j], p, t)
        rows, cols = linear_sum_assignment(weights, maximize=True)
        for row, col in zip(rows, cols, strict=True):
            if weights[row, col] < -1e8:
                col = int(np.argmax(weights[row]))
            orders[row].append(int(col))
    return [tuple(o) for o in orders]


def harmonic(n: int) -> float:
    """The n-th harmonic number ``1 + 1/2 + ... + 1/n``."""
    return float(sum(1.0 / k for k in range(1, n + 1)))


def deletion_rate_theory(shards: int, slices: int, distinct_first: int) -> float:
    """Expected deletions until every shard is dead: ``m L H_{m B'}``."""
    _check_budget(slices, distinct_first)
    check_int("shards", shards, minimum=1)
    return shards * slices * harmonic(shards * min(distinct_first, slices))


def expected_deletions(cell_probs: npt.ArrayLike) -> float:
    r"""Expected deletions until every cell of a set has been hit at least once.

    Each deletion hits cell ``c`` with probability ``p_c`` (independently, with
    replacement; cells outside the set take the rest). By Poissonisation (deletions
    at rate 1; Flajolet, Gardy and Thimonier 1992),

    .. math::

        E[\delta] = \int_0^\infty \Big(1 - \prod_c \big(1 - e^{-p_c t}\big)\Big)\,dt,

    which for ``m B'`` cells of probability ``1 / (m L)`` each is ``m L H_{m B'}``
    (:func:`deletion_rate_theory`); unequal slice sizes give unequal ``p_c``.
    """
    p = np.asarray(cell_probs, dtype=np.float64)
    if p.ndim != 1 or p.size == 0 or np.any(p <= 0) or p.sum() > 1 + 1e-9:
        raise ValueError(
            f"cell_probs must be probabilities > 0 summing to at most 1, got {p}"
        )

    def tail(t: float) -> float:
        return float(1.0 - np.prod(-np.expm1(-p * t)))

    total, _ = integrate.quad(tail, 0.0, np.inf, limit=200, epsabs=1e-10)
    if not np.isfinite(total):
        raise RuntimeError("expected_deletions: the integral did not converge")
    return float(total)


def simulate_deletion_rate(
    shards: int,
    orders: Sequence[Order],
    rng: np.random.Generator,
    runs: int = 2000,
    slice_probs: npt.ArrayLike | None = None,
) -> tuple[IntArray, IntArray]:
    """Monte-Carlo deletion rate at the slice level (no models).

    Each deletion hits shard ``s`` uniformly and slice ``j`` with ``slice_probs``
    (uniform if None); the shard's orders lose the suffix from ``j``. A shard dies
    when every order has lost its first slice.

    Returns
    -------
    (all_dead, first_dead) : arrays of shape (runs,)
        Deletions until every shard is dead, and until the first shard dies.
    """
    if not orders:
        raise ValueError("orders must not be empty")
    slices = len(orders[0])
    p = (
        np.full(slices, 1.0 / slices)
        if slice_probs is None
        else np.asarray(slice_probs, dtype=np.float64)
    )
    if p.shape != (slices,) or np.any(p < 0) or not np.isclose(p.sum(), 1.0):
        raise ValueError(f"slice_probs must be {slices} probabilities summing to 1")
    firsts = sorted({o[0] for o in orders})
    needed = np.array([s * slices + j for s in range(shards) for j in firsts])
    slot_probs = np.tile(p, shards) / shards
    rarest = float(p[firsts].min())
    if rarest <= 0:
        raise ValueError("a first slice has deletion probability 0: it never dies")
    horizon = max(64, int(8 * shards * harmonic(needed.size) / rarest))
    draws = rng.choice(shards * slices, size=(runs, horizon), p=slot_probs)
    first_hit = np.empty((runs, needed.size), dtype=np.int64)
    for column, slot in enumerate(needed):
        hit = draws == slot
        if not np.all(hit.any(axis=1)):
            raise RuntimeError("simulation horizon too short; a slice was never hit")
        first_hit[:, column] = np.argmax(hit, axis=1) + 1
    per_shard = first_hit.reshape(runs, shards, len(firsts)).max(axis=2)
    return per_shard.max(axis=1).astype(np.int64), per_shard.min(axis=1).astype(
        np.int64
    )
