r"""A client's own privacy: what it agreed to spend, and the ledger of what it spent.

Record-level DP in federated learning protects a client's records from whoever sees
its updates, the server first of all, so the client, not the server, decides what a
round may cost. A client holds

* a :class:`ClientPrivacy` (its budget :math:`(\varepsilon_n, \delta)` and how it
  spends it: noise multiplier, rounds, local steps, uniform or save-then-spend), from
  its own configuration, never from a server message; and
* a :class:`PrivacyLedger`: every round it answered, in this run and in every
  earlier one on the same records, as Opacus accountant history
  :math:`[(\sigma, q, k), \dots]`, kept durably on the client's own disk
  (:class:`federated.store.LedgerFile`).

A requested round :math:`t` with rate :math:`q`, noise multiplier :math:`\sigma` and
:math:`k` steps is granted only if :math:`\sigma > 0`, :math:`0 < q \le 1`,
:math:`k \ge 1`, :math:`t` is within the agreed rounds and after every round already
answered, the request is no less private than the client's own schedule for round
:math:`t` (:math:`q \le q_{n,t}`, :math:`\sigma \ge \sigma_{n,t}`,
:math:`k \le k_{n,t}`;
the schedule is solved by the same solver the server uses, so an honest proposal
matches it exactly), and the ledger with the new round stays within budget,
:math:`\varepsilon(\text{history} + [(\sigma, q, k)]) \le \varepsilon_n` (Opacus' RDP
accountant), the history covering every run (a lifetime budget). A granted round is
charged before any training, so a failure mid-round never leaves an unaccounted
release. Anything else raises :class:`RoundRefused`,
whose message names the round, the requested values and the budget (for the node's
log) and whose ``category`` is all the server is told.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from defenses.checks import check_choice, check_int, check_real
from defenses.fields import owner_key

from .accounting import (
    ACCOUNTANTS,
    Accountant,
    Phase,
    check_budget,
    epsilon,
    merge,
)
from .schedule import ClientSchedule, check_saving, plan_client

SPENDING = ("uniform", "time-adaptive")
MATCH_TOLERANCE = 1e-9
"""Relative slack when comparing a requested rate or sigma with the client's own
schedule (both sides run the same solver; this only absorbs float transport)."""


class RoundRefused(ValueError):
    """The client refuses a requested round; no update leaves it.

    ``category`` is all the server is told (the message stays in the node's log).
    """

    category: str = "refused"
    spent: float | None = None
    """For ``over-budget``: epsilon spent before the round (request history only)."""
    budget: float | None = None

    def __init__(self, message: str, category: str | None = None) -> None:
        super().__init__(message)
        if category is not None:
            self.category = category

    def reason(self) -> str:
        """What the server is told: the category; for over-budget, spent/budget.

        Both numbers are functions of the rounds granted (the values requested)
        and of the agreement, never of a record.
        """
        text = f"refused: {self.category}"
        if self.spent is not None and self.budget is not None:
            text += f" (spent epsilon {self.spent:.4f} of budget {self.budget:g})"
        return text


@dataclass(frozen=True)
class ClientPrivacy:
    """What a client agreed to spend over the run, from its own configuration.

    Parameters
    ----------
    epsilon : float
        The client's budget, > 0.
    delta : float
        Target delta, in (0, 1).
    rounds : int
        Rounds the client agreed to take part in, >= 1.
    steps : int
        Local DP-SGD steps per round, >= 1.
    sigma : float
        Noise multiplier of every step, > 0.
    spending : {"uniform", "time-adaptive"}
        Spend evenly, or save (``save_ratio`` x the uniform rate for the first
        ``save_fraction`` of the rounds) and then spend.
    save_fraction, save_ratio : float
        The saving phase (see :class:`federated.schedule.TimeAdaptive`).
    accountant : {"rdp", "prv"}
        Accountant of the ledger and the schedule.
    """

    epsilon: float
    delta: float
    rounds: int
    steps: int
    sigma: float
    spending: str = "time-adaptive"
    save_fraction: float = 0.5
    save_ratio: float = 0.7
    accountant: Accountant = "rdp"

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_budget(self.epsilon, f"{owner}.epsilon")
        check_real(
            f"{owner}.delta", self.delta, 0.0, 1.0, open_low=True, open_high=True
        )
        check_int(f"{owner}.rounds", self.rounds, 1)
        check_int(f"{owner}.steps", self.steps, 1)
        check_real(f"{owner}.sigma", self.sigma, 0.0, open_low=True)
        check_choice(f"{owner}.spending", self.spending, SPENDING)
        check_saving(owner_key(self), self.save_fraction, self.save_ratio)
        check_choice(f"{owner}.accountant", self.accountant, ACCOUNTANTS)

    @property
    def save_rounds(self) -> int:
        """Rounds in the saving phase (0 when spending uniformly)."""
        if self.spending == "uniform" or self.save_ratio == 1.0:
            return 0
        saved = round(self.save_fraction * self.rounds)
        if not 1 <= saved < self.rounds:
            raise ValueError(
                f"ClientPrivacy.save_fraction={self.save_fraction} of {self.rounds} "
                "rounds leaves no saving or no spending round"
            )
        return saved

    def schedule(self) -> ClientSchedule:
        """The client's own per-round plan (the solver of :mod:`federated.schedule`)."""
        return plan_client(
            float(self.epsilon),
            delta=float(self.delta),
            rounds=int(self.rounds),
            steps=int(self.steps),
            sigma=float(self.sigma),
            save_rounds=self.save_rounds,
            save_ratio=float(self.save_ratio),
            accountant=self.accountant,
        )

    def describe(self) -> str:
        """One line for error messages: the budget and the agreement."""
        return (
            f"budget epsilon={self.epsilon:g}, delta={self.delta:g} over "
            f"{self.rounds} rounds ({self.spending}, sigma={self.sigma:g})"
        )


@dataclass(frozen=True)
class Grant:
    """A round the client accepted: ``steps`` steps at ``rate`` and ``sigma``."""

    server_round: int
    rate: float
    sigma: float
    steps: int


def _number(name: str, value: object, integer: bool) -> float:
    """A requested value as a finite number (bool, text and NaN refused)."""
    if value is None:
        raise TypeError(f"{name} is missing")
    if isinstance(value, bool | np.bool_) or not isinstance(
        value, int | float | np.integer | np.floating
    ):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(float(value)):
        raise TypeError(f"{name} must be finite, got {value!r}")
    if integer and int(value) != value:
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return float(value)


@dataclass
class PrivacyLedger:
    """Every round a client answered, accounted with Opacus, checked before training.

    Parameters
    ----------
    privacy : ClientPrivacy
        What the client agreed to.
    answered : list of Grant
        Rounds already granted in this run, in order.
    earlier : list of Grant
        Rounds granted in earlier runs on the same records (the lifetime ledger,
        :class:`federated.store.LedgerFile`): they count against the budget.
    """

    privacy: ClientPrivacy
    answered: list[Grant] = field(default_factory=list)
    earlier: list[Grant] = field(default_factory=list)
    STATE_KEYS: ClassVar[tuple[str, ...]] = ("round", "rate", "sigma", "steps")

    def history(self) -> list[Phase]:
        """Accountant history ``[(sigma, q, steps), ...]`` of every granted round."""
        grants = [*self.earlier, *self.answered]
        return merge([(g.sigma, g.rate, g.steps) for g in grants])

    def accountant(self) -> object:
        """An Opacus accountant holding this ledger's history."""
        from opacus.accountants import create_accountant

        acc = create_accountant(self.privacy.accountant)
        acc.history = self.history()
        return acc

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far at the client's delta (the only one it reports)."""
        return epsilon(self.history(), self.privacy.delta, self.privacy.accountant)

    def _refuse(
        self, server_round: object, request: str, why: str, category: str
    ) -> RoundRefused:
        return RoundRefused(
            f"round {server_round} refused ({request}): {why}; the client's "
            f"{self.privacy.describe()}, spent so far {self.epsilon:.4f}",
            category,
        )

    def check(
        self, server_round: object, rate: object, sigma: object, steps: object
    ) -> Grant:
        """The round as a :class:`Grant` if the client accepts it, else raise.

        Raises
        ------
        RoundRefused
            For a missing or non-positive sigma, a rate outside (0, 1], a step
            count < 1, a round beyond the agreed ones or not after the last
            answered one (a replay), a request less private than the client's own
            schedule, or one that would take the ledger past the budget.
        """
        request = f"rate={rate!r}, sigma={sigma!r}, steps={steps!r}"
        try:
            t = int(_number("server-round", server_round, integer=True))
            q = _number("rate", rate, integer=False)
            s = _number("sigma", sigma, integer=False)
            k = int(_number("steps", steps, integer=True))
        except TypeError as error:
            raise self._refuse(
                server_round, request, str(error), "bad-request"
            ) from None
        if s <= 0:
            raise self._refuse(
                t, request, "sigma must be > 0 (no noise, no privacy)", "bad-request"
            )
        if not 0.0 < q <= 1.0:
            raise self._refuse(t, request, "the rate must lie in (0, 1]", "bad-request")
        if k < 1:
            raise self._refuse(t, request, "steps must be >= 1", "bad-request")
        agreed = self.privacy.rounds
        if not 1 <= t <= agreed:
            raise self._refuse(
                t,
                request,
                f"server-round: the client agreed to rounds 1..{agreed}",
                "beyond-agreed-rounds",
            )
        if self.answered and t <= self.answered[-1].server_round:
            raise self._refuse(
                t,
                request,
                f"server-round: round {self.answered[-1].server_round} was already "
                "answered (a replayed or out-of-order round)",
                "replayed-round",
            )
        own = self.privacy.schedule().rounds[t - 1]
        if (
            q > own.rate * (1 + MATCH_TOLERANCE)
            or s < own.sigma * (1 - MATCH_TOLERANCE)
            or k > own.steps
        ):
            raise self._refuse(
                t,
                request,
                f"less private than the client's own schedule for round {t} "
                f"(rate={own.rate:.6g}, sigma={own.sigma:g}, steps={own.steps})",
                "less-private-than-agreed",
            )
        grant = Grant(t, q, s, k)
        after = epsilon(
            [*self.history(), (s, q, k)], self.privacy.delta, self.privacy.accountant
        )
        if after > self.privacy.epsilon:
            refused = self._refuse(
                t,
                request,
                f"it would spend epsilon {after:.4f} in all runs, over the budget",
                "over-budget",
            )
            refused.spent, refused.budget = self.epsilon, float(self.privacy.epsilon)
            raise refused
        return grant

    def grant(
        self, server_round: object, rate: object, sigma: object, steps: object
    ) -> Grant:
        """Check the round and charge it to the ledger before any training."""
        accepted = self.check(server_round, rate, sigma, steps)
        self.answered.append(accepted)
        return accepted

    def state(self) -> dict[str, list[int] | list[float]]:
        """The ledger as lists of numbers (for a Flower ``ConfigRecord``)."""
        return {
            "round": [g.server_round for g in self.answered],
            "rate": [g.rate for g in self.answered],
            "sigma": [g.sigma for g in self.answered],
            "steps": [g.steps for g in self.answered],
        }

    @classmethod
    def from_state(
        cls, privacy: ClientPrivacy, state: Mapping[str, object] | None
    ) -> PrivacyLedger:
        """Rebuild a ledger from :meth:`state` (``None``: nothing answered yet)."""
        if state is None:
            return cls(privacy)
        columns: list[Sequence[float]] = []
        for key in cls.STATE_KEYS:
            value = state[key]
            if not isinstance(value, list):
                raise ValueError(f"ledger state {key!r} must be a list, got {value!r}")
            columns.append(value)
        if len({len(c) for c in columns}) != 1:
            raise ValueError("ledger state columns differ in length")
        answered = [
            Grant(int(t), float(q), float(s), int(k))
            for t, q, s, k in zip(*columns, strict=True)
        ]
        return cls(privacy, answered)
