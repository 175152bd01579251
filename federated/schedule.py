r"""Per-client privacy-spending schedules: uniform, time-adaptive, strict-group-only.

Time-adaptive privacy spending (Kiani et al., "Differentially Private Federated
Learning with Time-Adaptive Privacy Spending", ICLR 2025) as reconstructed in the
research note: every client keeps one noise multiplier :math:`\sigma` and changes its
Poisson sampling rate over time. Client :math:`n` with budget
:math:`(\varepsilon_n, \delta)`, :math:`T` rounds of :math:`K` local steps:

.. math::

    q_n^{unif} &= \max\{q : \varepsilon([(\sigma, q, TK)]) \le \varepsilon_n\} \\
    q_n^{sav}  &= r\, q_n^{unif} \quad (0 < r \le 1) \\
    q_n^{spd}  &= \max\{q : \varepsilon([(\sigma, q_n^{sav}, T^{sav}K),
                  (\sigma, q, (T - T^{sav})K)]) \le \varepsilon_n\}

and round :math:`t` runs at :math:`q_n^{sav}` for :math:`t \le T^{sav}`, else at
:math:`q_n^{spd}`. Since :math:`q^{spd} \ge q^{sav}` and per-step RDP grows with
:math:`q`, the per-round spending is non-decreasing in time. ``Uniform`` is
:math:`r = 1`; ``StrictOnly`` lets only clients at the strictest budget save (the
paper's analysis: strict clients gain from uneven spending, relaxed ones should spread
it evenly). Every solved schedule is checked to spend within ``tolerance`` of its
budget and never more. [R] reconstructed: the paper's own rules for choosing
:math:`T^{sav}` and :math:`r` are not public to us; here they are hyper-parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from defenses.checks import check_int, check_real
from defenses.fields import Key, owner_key

from .accounting import (
    Accountant,
    Phase,
    check_budget,
    check_target,
    epsilon,
    merge,
    solve_spend_rate,
    solve_uniform_rate,
)


@dataclass(frozen=True)
class Round:
    """One round of local DP-SGD: ``steps`` steps at rate ``rate`` and ``sigma``."""

    sigma: float
    rate: float
    steps: int


@dataclass(frozen=True)
class ClientSchedule:
    """A client's per-round plan and its budget.

    Parameters
    ----------
    budget : float
        Target epsilon.
    delta : float
        Target delta.
    rounds : tuple of Round
        One entry per federated round, in time order.
    accountant : {"rdp", "prv"}
        Accountant the schedule was calibrated with.
    """

    budget: float
    delta: float
    rounds: tuple[Round, ...]
    accountant: Accountant = "rdp"

    def history(self, upto: int | None = None) -> list[Phase]:
        """Merged ``(sigma, q, steps)`` phases of the first ``upto`` rounds."""
        chosen = self.rounds if upto is None else self.rounds[:upto]
        return merge([(r.sigma, r.rate, r.steps) for r in chosen])

    def epsilon(self, accountant: Accountant | None = None) -> float:
        """Epsilon of the whole plan (with the calibration accountant by default)."""
        return epsilon(self.history(), self.delta, accountant or self.accountant)

    def round_costs(self) -> list[float]:
        """Epsilon of each round's mechanism on its own: the per-round spending."""
        return [
            epsilon([(r.sigma, r.rate, r.steps)], self.delta, self.accountant)
            for r in self.rounds
        ]

    @property
    def rates(self) -> list[float]:
        """Sampling rate of each round."""
        return [r.rate for r in self.rounds]


@dataclass(frozen=True)
class Uniform:
    """Spend evenly: the same sampling rate in every round (IDP-FedAvg)."""

    name: ClassVar[str] = "uniform"

    def saves(self, budget: float, budgets: Sequence[float]) -> bool:
        """Uniform spending never saves."""
        return False

    @property
    def save_fraction(self) -> float:
        """Fraction of rounds in the saving phase (0)."""
        return 0.0

    @property
    def save_ratio(self) -> float:
        """Saving rate as a fraction of the uniform rate (1)."""
        return 1.0


def check_saving(key: Key, save_fraction: float, save_ratio: float) -> None:
    """Raise ValueError, naming the field by ``key``, unless the saving phase is valid.

    ``save_fraction`` (the share of rounds spent saving) must lie in (0, 1) and
    ``save_ratio`` (the saving rate over the uniform rate) in (0, 1]. The schedule,
    a client's own agreement and the Flower app's config check them here.
    """
    check_real(
        key("save_fraction"), save_fraction, 0.0, 1.0, open_low=True, open_high=True
    )
    check_real(key("save_ratio"), save_ratio, 0.0, 1.0, open_low=True)


@dataclass(frozen=True)
class TimeAdaptive:
    """Save, then spend: every client saves first, then spends what it saved.

    Each client runs ``save_ratio`` x its uniform rate for the first
    ``save_fraction`` of the rounds and solves its spending rate for the rest.

    Parameters
    ----------
    save_fraction : float
        Fraction of rounds in the saving phase, in (0, 1).
    save_ratio : float
        Saving rate over uniform rate, in (0, 1].
    """

    name: ClassVar[str] = "time-adaptive"
    save_fraction: float = 0.5
    save_ratio: float = 0.7

    def __post_init__(self) -> None:
        check_saving(owner_key(self), self.save_fraction, self.save_ratio)

    def saves(self, budget: float, budgets: Sequence[float]) -> bool:
        """Every client saves."""
        return True


@dataclass(frozen=True)
class StrictOnly(TimeAdaptive):
    """Only clients at the strictest budget save; the others spend uniformly.

    The parameters are :class:`TimeAdaptive`'s.
    """

    name: ClassVar[str] = "strict-only"

    def saves(self, budget: float, budgets: Sequence[float]) -> bool:
        """Only the strictest group saves."""
        return budget <= min(budgets)


Policy = Uniform | TimeAdaptive | StrictOnly


def plan_client(
    budget: float,
    *,
    delta: float,
    rounds: int,
    steps: int,
    sigma: float,
    save_rounds: int = 0,
    save_ratio: float = 1.0,
    accountant: Accountant = "rdp",
    tolerance: float = 0.005,
) -> ClientSchedule:
    """Schedule for one client; ``save_rounds = 0`` or ``save_ratio = 1`` is uniform.

    Raises
    ------
    ValueError
        On a bad parameter, or (as ``UnreachableBudget``) when no rate in (0, 1]
        spends the budget.
    """
    budget, delta = check_target(budget, delta, accountant)
    rounds = check_int("rounds", rounds, 1)
    steps = check_int("steps", steps, 1)
    sigma = check_real("sigma", sigma, 0.0, open_low=True)
    save_rounds = check_int("save_rounds", save_rounds, 0)
    save_ratio = check_real("save_ratio", save_ratio, 0.0, 1.0, open_low=True)
    if not 0 <= save_rounds < rounds:
        raise ValueError(
            f"save_rounds must lie in [0, rounds={rounds}), got {save_rounds}"
        )
    q_unif = solve_uniform_rate(
        budget, delta, sigma, rounds * steps, accountant, tolerance
    )
    if save_rounds == 0 or save_ratio == 1.0:
        plan = [Round(sigma, q_unif, steps)] * rounds
    else:
        q_sav = save_ratio * q_unif
        q_spd = solve_spend_rate(
            budget,
            delta,
            sigma,
            q_sav,
            save_rounds * steps,
            (rounds - save_rounds) * steps,
            accountant,
            tolerance,
        )
        plan = [Round(sigma, q_sav, steps)] * save_rounds + [
            Round(sigma, q_spd, steps)
        ] * (rounds - save_rounds)
    schedule = ClientSchedule(float(budget), float(delta), tuple(plan), accountant)
    spent = schedule.epsilon()
    if not (1.0 - 2 * tolerance) * budget <= spent <= budget:
        raise ValueError(
            f"schedule spends epsilon={spent:.4f}, not within {2 * tolerance:.1%} "
            f"below budget {budget}"
        )
    return schedule


def plan_schedules(
    budgets: Sequence[float],
    policy: Policy,
    *,
    delta: float,
    rounds: int,
    steps: int,
    sigma: float,
    accountant: Accountant = "rdp",
) -> list[ClientSchedule]:
    """One schedule per client under ``policy``; all are solved before any training.

    Raises
    ------
    ValueError
        For an empty budget list, a budget <= 0, a delta outside (0, 1), or a budget
        no schedule can meet.
    """
    if not isinstance(policy, Uniform | TimeAdaptive | StrictOnly):
        raise TypeError(
            "policy must be a Uniform, TimeAdaptive or StrictOnly instance, got "
            f"{policy!r}"
        )
    if isinstance(budgets, str | bytes) or not isinstance(budgets, Sequence):
        raise TypeError(f"budgets must be a list of epsilons, got {budgets!r}")
    if len(budgets) == 0:
        raise ValueError("budgets must list one epsilon per client, got none")
    for i, b in enumerate(budgets):
        check_budget(b, f"budgets[{i}]")
    save_rounds = round(policy.save_fraction * rounds)
    if policy.save_fraction > 0 and not 1 <= save_rounds < rounds:
        raise ValueError(
            f"save_fraction={policy.save_fraction} of {rounds} rounds leaves no "
            "saving or no spending round; use more rounds or another fraction"
        )
    return [
        plan_client(
            float(b),
            delta=delta,
            rounds=rounds,
            steps=steps,
            sigma=sigma,
            save_rounds=save_rounds if policy.saves(b, budgets) else 0,
            save_ratio=policy.save_ratio,
            accountant=accountant,
        )
        for b in budgets
    ]
