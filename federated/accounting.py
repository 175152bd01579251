r"""Privacy accounting of heterogeneous DP-SGD histories with Opacus.

A client's *history* is the time-ordered list of phases ``(sigma, q, steps)`` it ran:
``steps`` steps of the Poisson-subsampled Gaussian mechanism with sampling rate ``q``
and noise multiplier ``sigma``. Its epsilon at ``delta`` comes from Opacus:

* ``"rdp"`` - :class:`opacus.accountants.RDPAccountant`: Rényi DP of the subsampled
  Gaussian (Mironov et al., 2019) summed over the phases,
  :math:`\rho(\alpha) = \sum_i k_i\,\rho_{q_i,\sigma_i}(\alpha)`, converted with
  :math:`\varepsilon = \min_\alpha \rho(\alpha) + \log((\alpha-1)/\alpha)
  - (\log\delta + \log\alpha)/(\alpha-1)` (Balle et al., 2020);
* ``"prv"`` - :class:`opacus.accountants.PRVAccountant`: numerical composition of
  privacy-loss random variables (Gopi et al., 2021), tighter than RDP.

No RDP is written by hand here. The solvers bisect a sampling rate so that the
accounted epsilon lands in ``[(1 - tolerance) * budget, budget]``; results are cached
because one accountant call costs tens of milliseconds.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Literal, NamedTuple

from defenses.checks import check_int, check_real

Accountant = Literal["rdp", "prv"]
ORDERS: tuple[float, ...] = (
    1.1, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0,
    10.0, 12.0, 14.0, 16.0, 20.0, 24.0, 28.0, 32.0, 40.0, 48.0, 64.0, 128.0, 256.0,
)  # fmt: skip
"""Rényi orders of the RDP accountant: fewer fractional orders than Opacus's default
grid (4x faster); the minimum over a subset of orders is a valid, slightly looser
bound, and calibration and certification use the same grid."""
ACCOUNTANTS: tuple[Accountant, ...] = ("rdp", "prv")
Phase = tuple[float, float, int]


class UnreachableBudget(ValueError):
    """No sampling rate in the allowed range makes epsilon hit the budget."""


def check_delta(delta: object) -> float:
    """``delta`` as a float; ValueError unless ``0 < delta < 1``."""
    return check_real("delta", delta, 0.0, 1.0, open_low=True, open_high=True)


def check_budget(budget: object, what: str = "budget") -> float:
    """``budget`` as a float; ValueError unless it is a finite number > 0."""
    return check_real(what, budget, 0.0, open_low=True)


def check_accountant(accountant: str) -> None:
    """Raise ValueError unless ``accountant`` is one of :data:`ACCOUNTANTS`."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def check_history(history: Sequence[Phase]) -> list[Phase]:
    """Validate and normalise a history; return it as a list of float/int tuples."""
    out: list[Phase] = []
    if isinstance(history, str | bytes) or not isinstance(history, Sequence):
        raise TypeError(f"history must be a list of (sigma, q, steps), got {history!r}")
    for i, item in enumerate(history):
        if not isinstance(item, Sequence) or len(item) != 3:
            raise ValueError(f"history[{i}] must be (sigma, q, steps), got {item!r}")
        sigma = check_real(f"history[{i}] sigma", item[0], 0.0, open_low=True)
        q = check_real(f"history[{i}] q", item[1], 0.0, 1.0)
        steps = check_int(f"history[{i}] steps", item[2], 0)
        if steps > 0 and q > 0:
            out.append((sigma, q, steps))
    return out


def merge(history: Sequence[Phase]) -> list[Phase]:
    """Merge consecutive phases with equal (sigma, q) into one, summing steps."""
    merged: list[Phase] = []
    for sigma, q, steps in history:
        if merged and merged[-1][0] == sigma and merged[-1][1] == q:
            merged[-1] = (sigma, q, merged[-1][2] + steps)
        else:
            merged.append((sigma, q, steps))
    return merged


@functools.lru_cache(maxsize=4096)
def _epsilon_cached(history: tuple[Phase, ...], delta: float, accountant: str) -> float:
    if not history:
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            eps = _accounted(history, delta, accountant)
        except (ArithmeticError, ValueError) as error:  # e.g. sigma near 0 or huge
            # (Opacus's RDP analysis raises ValueError from its log-subtraction at
            # sigma = 7.5e7, q = 0.5: the refusal names sigma and q instead)
            raise ValueError(
                f"the {accountant} accountant cannot evaluate (sigma, q) "
                f"{[(p[0], p[1]) for p in history]} at delta={delta}: {error!r}"
            ) from None
    if math.isnan(eps):
        raise ValueError(
            f"the {accountant} accountant returned NaN for (sigma, q, steps) {history}"
        )
    return eps


def _accounted(history: tuple[Phase, ...], delta: float, accountant: str) -> float:
    from opacus.accountants import PRVAccountant, RDPAccountant

    if accountant == "rdp":
        rdp = RDPAccountant()
        rdp.history = list(history)
        return float(rdp.get_privacy_spent(delta=delta, alphas=list(ORDERS))[0])
    prv = PRVAccountant()
    prv.history = list(history)
    return float(prv.get_epsilon(delta=delta))


def epsilon(
    history: Sequence[Phase], delta: float, accountant: Accountant = "rdp"
) -> float:
    """Epsilon at ``delta`` of a heterogeneous history ``[(sigma, q, steps), ...]``.

    An empty history (or one whose phases all have ``q = 0`` or no steps) spends 0.
    """
    delta = check_delta(delta)
    check_accountant(accountant)
    return _epsilon_cached(tuple(merge(check_history(history))), delta, accountant)


class Target(NamedTuple):
    """What a solver aims at: epsilon in ``[(1 - tolerance) budget, budget]``.

    The checked ``(budget, delta, accountant, tolerance)`` of every solver below, one
    hashable value, so the cached solvers key on it whole.
    """

    budget: float
    delta: float
    accountant: str
    tolerance: float

    @property
    def floor(self) -> float:
        """The least accepted epsilon, ``(1 - tolerance) * budget``."""
        return (1.0 - self.tolerance) * self.budget

    def hit(self, eps: float) -> bool:
        """Whether ``eps`` lies in the accepted window ``[floor, budget]``."""
        return self.floor <= eps <= self.budget

    def epsilon(self, history: Sequence[Phase]) -> float:
        """Epsilon of a checked ``history`` at this target's delta (cached)."""
        return _epsilon_cached(tuple(merge(history)), self.delta, self.accountant)


@functools.lru_cache(maxsize=1024)
def _bisect_rate(
    target: Target, prefix: tuple[Phase, ...], sigma: float, steps: int, low: float
) -> float:
    """Largest q in [low, 1] with eps(prefix + (sigma, q, steps)) <= budget."""
    budget, delta, _, tolerance = target

    def eps_at(q: float) -> float:
        return target.epsilon([*prefix, (sigma, q, steps)])

    if eps_at(low) > budget:
        raise UnreachableBudget(
            f"budget {budget} at delta={delta} is already exceeded at the smallest "
            f"allowed rate q={low:.4g} (epsilon {eps_at(low):.4g}); lower the saving "
            "rate, raise sigma or delta"
        )
    top = eps_at(1.0)
    if top <= budget:
        if top < target.floor:
            raise UnreachableBudget(
                f"budget {budget} cannot be spent: even q=1 for {steps} steps at "
                f"sigma={sigma} only reaches epsilon={top:.4g}; lower sigma or the "
                "budget, or add rounds"
            )
        return 1.0
    # Illinois (regula falsi) on log q against log epsilon, which is close to
    # linear; the accepted window is [(1 - tolerance) budget, budget].
    aim = math.log((1.0 - tolerance / 2) * budget)
    lo = max(low, 1e-9)
    e_lo = eps_at(lo)
    if e_lo >= target.floor:
        return lo
    x_lo, x_hi = math.log(lo), 0.0
    y_lo = math.log(max(e_lo, 1e-300)) - aim
    y_hi = math.log(top) - aim
    side = 0
    for _ in range(100):
        x = x_hi - y_hi * (x_hi - x_lo) / (y_hi - y_lo)
        if not x_lo < x < x_hi:
            x = 0.5 * (x_lo + x_hi)
        q = math.exp(x)
        e = eps_at(q)
        if target.hit(e):
            return q
        y = math.log(max(e, 1e-300)) - aim
        if y > 0:
            x_hi, y_hi = x, y
            if side == 1:
                y_lo /= 2
            side = 1
        else:
            x_lo, y_lo = x, y
            if side == -1:
                y_hi /= 2
            side = -1
    raise UnreachableBudget(
        f"could not place epsilon within {tolerance:.1%} of budget {budget}"
    )


def check_target(budget: object, delta: object, accountant: str) -> tuple[float, float]:
    """The ``(budget, delta)`` a solver aims at, checked with its ``accountant``.

    The first checks of every solver below: the budget a finite number > 0, delta in
    (0, 1) and the accountant one of :data:`ACCOUNTANTS`.
    """
    target = check_budget(budget), check_delta(delta)
    check_accountant(accountant)
    return target


def solver_target(
    budget: object, delta: object, accountant: str, tolerance: object
) -> Target:
    """The checked :class:`Target` of a solver.

    :func:`check_target`, then ``tolerance`` in (0, 1].
    """
    budget, delta = check_target(budget, delta, accountant)
    tolerance = check_real("tolerance", tolerance, 0.0, 1.0, open_low=True)
    return Target(budget, delta, accountant, tolerance)


def solve_uniform_rate(
    budget: float,
    delta: float,
    sigma: float,
    steps: int,
    accountant: Accountant = "rdp",
    tolerance: float = 0.005,
) -> float:
    """Sampling rate q with eps([(sigma, q, steps)]) in [(1 - tol) budget, budget].

    Raises
    ------
    UnreachableBudget
        If even q = 1 spends less than the budget.
    """
    target = solver_target(budget, delta, accountant, tolerance)
    sigma = check_real("sigma", sigma, 0.0, open_low=True)
    return _bisect_rate(target, (), sigma, check_int("steps", steps, 1), 0.0)


def solve_spend_rate(
    budget: float,
    delta: float,
    sigma: float,
    save_rate: float,
    save_steps: int,
    spend_steps: int,
    accountant: Accountant = "rdp",
    tolerance: float = 0.005,
) -> float:
    r"""Spending rate after ``save_steps`` steps at ``save_rate``, hitting the budget.

    Solves :math:`\max q \ge q_{sav}` s.t.
    :math:`\varepsilon([(\sigma, q_{sav}, k_{sav}), (\sigma, q, k_{spd})]) \le
    \varepsilon_n`, so the spending rate is never below the saving rate.

    Raises
    ------
    UnreachableBudget
        If the saving phase alone exceeds the budget or q = 1 cannot spend it.
    """
    target = solver_target(budget, delta, accountant, tolerance)
    sigma = check_real("sigma", sigma, 0.0, open_low=True)
    save_rate = check_real("save_rate", save_rate, 0.0, 1.0, open_low=True)
    save_steps = check_int("save_steps", save_steps, 0)
    prefix = tuple(check_history([(sigma, save_rate, save_steps)]))
    spend_steps = check_int("spend_steps", spend_steps, 1)
    return _bisect_rate(target, prefix, sigma, spend_steps, save_rate)


def solve_noise_multiplier(
    budget: float,
    delta: float,
    rate: float,
    steps: int,
    accountant: Accountant = "rdp",
    tolerance: float = 0.005,
) -> float:
    """Smallest noise multiplier (to ``tolerance``) with eps <= budget.

    Bisects sigma on a log scale in [0.05, 1000] so that
    ``eps([(sigma, rate, steps)])`` lies in ``[(1 - tolerance) budget, budget]``.
    """
    target = solver_target(budget, delta, accountant, tolerance)
    rate = check_real("rate", rate, 0.0, 1.0, open_low=True)
    return _noise_multiplier(target, rate, check_int("steps", steps, 1))


@functools.lru_cache(maxsize=256)
def _noise_multiplier(target: Target, rate: float, steps: int) -> float:
    def eps_at(sigma: float) -> float:
        return target.epsilon([(sigma, rate, steps)])

    budget = target.budget
    lo, hi = math.log(0.05), math.log(1000.0)
    if eps_at(math.exp(hi)) > budget:
        raise UnreachableBudget(f"budget {budget} needs sigma > 1000")
    if eps_at(math.exp(lo)) <= budget:
        raise UnreachableBudget(f"budget {budget} is not spent even at sigma = 0.05")
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        e = eps_at(math.exp(mid))
        if target.hit(e):
            return math.exp(mid)
        if e > budget:
            lo = mid
        else:
            hi = mid
    raise UnreachableBudget(
        f"could not place epsilon within {target.tolerance:.1%} of {budget}"
    )
