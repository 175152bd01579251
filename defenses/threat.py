"""Threat models as data.

A :class:`ThreatModel` says what an adversary wants (:class:`Goal`), when it acts
(:class:`Stage`), what it knows (:class:`Knowledge`), what it may do
(:class:`Capability`) and how much of it (:class:`Budget`). Scenarios declare one;
attacks declare the capabilities they need; the harness refuses a pairing the threat
model does not grant (:meth:`ThreatModel.require`). The vocabulary follows NIST AI
100-2 (adversarial machine learning taxonomy).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class ThreatModelViolation(PermissionError):
    """An attack asked for a capability its threat model does not grant."""


class Goal(enum.StrEnum):
    """What the adversary wants to break."""

    CONFIDENTIALITY = "confidentiality"
    INTEGRITY = "integrity"
    AVAILABILITY = "availability"


class Stage(enum.StrEnum):
    """When the adversary acts: on the training pipeline or on the deployed system."""

    TRAINING = "training"
    DEPLOYMENT = "deployment"


class Knowledge(enum.StrEnum):
    """How much the adversary knows of the system (a label for tables)."""

    BLACK_BOX = "black-box"
    GRAY_BOX = "gray-box"
    WHITE_BOX = "white-box"


class Capability(enum.StrEnum):
    """What the adversary may do; the harness enforces these."""

    QUERY_LABEL = "query-label"
    QUERY_SCORES = "query-scores"
    READ_PARAMETERS = "read-parameters"
    OBSERVE_TRAFFIC = "observe-traffic"
    POISON_TRAIN = "poison-train"
    POISON_CALIBRATION = "poison-calibration"
    REQUEST_DELETION = "request-deletion"
    AUX_DATA = "aux-data"


POISONING = frozenset({Capability.POISON_TRAIN, Capability.POISON_CALIBRATION})
QUERYING = frozenset({Capability.QUERY_LABEL, Capability.QUERY_SCORES})
NORMS = ("l1", "l2", "linf")


def _check_nonnegative(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(
        value, int | float | np.integer | np.floating
    ):
        raise TypeError(f"Budget.{name} must be a number or None, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Budget.{name} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Budget:
    """How much the adversary may do.

    Parameters
    ----------
    queries : int or None
        Maximum number of inputs it may submit to the deployed system.
    poison_fraction : float or None
        Fraction of a training or calibration split it may replace, in [0, 1].
    radius : float or None
        Perturbation radius of an input attack; requires ``norm``.
    norm : {"l1", "l2", "linf"} or None
        Norm in which ``radius`` is measured.
    """

    queries: int | None = None
    poison_fraction: float | None = None
    radius: float | None = None
    norm: str | None = None

    def __post_init__(self) -> None:
        if self.queries is not None and (
            isinstance(self.queries, bool)
            or not isinstance(self.queries, int | np.integer)
        ):
            raise TypeError(
                f"Budget.queries must be an int or None, got {self.queries!r}"
            )
        _check_nonnegative("queries", self.queries)
        for name in ("queries", "poison_fraction", "radius"):
            value = getattr(self, name)
            if value is not None:
                cast = int if name == "queries" else float
                object.__setattr__(self, name, cast(value))
        _check_nonnegative("poison_fraction", self.poison_fraction)
        _check_nonnegative("radius", self.radius)
        if self.poison_fraction is not None and self.poison_fraction > 1:
            raise ValueError(
                "Budget.poison_fraction must lie in [0, 1], "
                f"got {self.poison_fraction!r}"
            )
        if self.norm is not None and self.norm not in NORMS:
            raise ValueError(f"Budget.norm must be one of {NORMS}, got {self.norm!r}")
        if (self.radius is None) != (self.norm is None):
            raise ValueError(
                "Budget.radius and Budget.norm go together: "
                f"got radius={self.radius!r}, norm={self.norm!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Return the budget as a JSON-ready dict (every field, None where unset)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class ThreatModel:
    """Who the adversary is, as data.

    Consistency rules checked at construction:

    * at least one capability;
    * ``WHITE_BOX`` knowledge if and only if ``READ_PARAMETERS`` is granted;
    * a ``TRAINING``-stage adversary holds a poisoning capability, and a poisoning
      capability is only granted at the training stage;
    * a query budget needs a query capability, a poison fraction a poisoning one.
    """

    goal: Goal
    stage: Stage
    knowledge: Knowledge
    capabilities: frozenset[Capability]
    budget: Budget = field(default_factory=Budget)
    adaptive: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "goal", Goal(self.goal))
        object.__setattr__(self, "stage", Stage(self.stage))
        object.__setattr__(self, "knowledge", Knowledge(self.knowledge))
        caps = frozenset(Capability(c) for c in self.capabilities)
        object.__setattr__(self, "capabilities", caps)
        if not caps:
            raise ValueError("ThreatModel.capabilities must not be empty")
        white = self.knowledge is Knowledge.WHITE_BOX
        if white != (Capability.READ_PARAMETERS in caps):
            raise ValueError(
                "ThreatModel.knowledge is white-box exactly when 'read-parameters' is "
                f"granted: got knowledge={self.knowledge.value!r}, "
                f"capabilities={sorted(caps)}"
            )
        poisons = bool(caps & POISONING)
        if (self.stage is Stage.TRAINING) != poisons:
            raise ValueError(
                "ThreatModel.stage is 'training' exactly when a poisoning capability "
                f"({sorted(POISONING)}) is granted: got stage={self.stage.value!r}, "
                f"capabilities={sorted(caps)}"
            )
        if self.budget.queries is not None and not caps & QUERYING:
            raise ValueError(
                f"Budget.queries={self.budget.queries} needs a query capability "
                f"({sorted(QUERYING)}); capabilities={sorted(caps)}"
            )
        if self.budget.poison_fraction is not None and not poisons:
            raise ValueError(
                f"Budget.poison_fraction={self.budget.poison_fraction} needs a "
                f"poisoning capability; capabilities={sorted(caps)}"
            )

    @classmethod
    def granting(
        cls,
        goal: Goal | str,
        *capabilities: Capability | str,
        knowledge: Knowledge | str = Knowledge.BLACK_BOX,
        budget: Budget | None = None,
        adaptive: bool = False,
    ) -> ThreatModel:
        """The threat model of a ``goal`` with these capabilities, the rest implied.

        The consistency rules fix two fields: the stage is ``TRAINING`` exactly when a
        poisoning capability is granted, and the knowledge is ``WHITE_BOX`` exactly
        when ``READ_PARAMETERS`` is (``knowledge`` is then ignored).

        Examples
        --------
        >>> ThreatModel.granting("confidentiality", "query-scores").stage.value
        'deployment'
        >>> ThreatModel.granting("integrity", "read-parameters").knowledge.value
        'white-box'
        """
        caps = frozenset(Capability(c) for c in capabilities)
        return cls(
            goal=Goal(goal),
            stage=Stage.TRAINING if caps & POISONING else Stage.DEPLOYMENT,
            knowledge=(
                Knowledge.WHITE_BOX
                if Capability.READ_PARAMETERS in caps
                else Knowledge(knowledge)
            ),
            capabilities=caps,
            budget=budget if budget is not None else Budget(),
            adaptive=adaptive,
        )

    def grants(self, capability: Capability) -> bool:
        """Return whether ``capability`` is granted."""
        return capability in self.capabilities

    def require(self, needs: Iterable[Capability], who: str) -> None:
        """Raise :class:`ThreatModelViolation` naming what ``who`` needs but lacks."""
        missing = frozenset(needs) - self.capabilities
        if missing:
            raise ThreatModelViolation(
                f"{who} needs {', '.join(sorted(missing))}, which the threat model "
                f"does not grant (granted: {', '.join(sorted(self.capabilities))})"
            )

    def to_dict(self) -> dict[str, Any]:
        """Return the threat model as a JSON-ready dict."""
        return {
            "goal": self.goal.value,
            "stage": self.stage.value,
            "knowledge": self.knowledge.value,
            "capabilities": sorted(c.value for c in self.capabilities),
            "budget": self.budget.to_dict(),
            "adaptive": self.adaptive,
        }
