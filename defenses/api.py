"""The protocols every package speaks.

The evaluation is a security game (as in membership-inference experiments): a
:class:`Scenario` (the challenger) sets up data and secrets (a *task* ``T``), trains a
*system* ``S`` with a :class:`Learner`, exposes a *view* ``V`` that its threat model
allows, and judges the adversary's *guess* ``G``. A :class:`Defense` wraps a learner
into a learner of the same interface; one with a formal guarantee is also
:class:`Certifiable`. Deployment-stage attacks are :class:`InferenceAttack` (query or
observe, then guess); training-stage attacks are :class:`PoisoningAttack` (rewrite the
task before fitting).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np

from defenses.threat import Capability, ThreatModel

Metrics = Mapping[str, float]

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)
S = TypeVar("S")
S_co = TypeVar("S_co", covariant=True)
S_contra = TypeVar("S_contra", contravariant=True)
V_co = TypeVar("V_co", covariant=True)
V_contra = TypeVar("V_contra", contravariant=True)
G_co = TypeVar("G_co", covariant=True)
G = TypeVar("G")


class DefenseKind(enum.StrEnum):
    """Where a defense acts (the taxonomy of IBM ART's ``defences`` package)."""

    PREPROCESSOR = "preprocessor"
    POSTPROCESSOR = "postprocessor"
    TRAINER = "trainer"
    TRANSFORMER = "transformer"
    DETECTOR = "detector"


class Learner(Protocol[T_contra, S_co]):
    """Anything that turns a task into a fitted system."""

    def fit(self, task: T_contra, rng: np.random.Generator) -> S_co:
        """Train on ``task`` using only the randomness of ``rng``."""
        ...


@runtime_checkable
class Defense(Protocol):
    """A learner-to-learner wrapper that keeps the learner's interface.

    ``wrap`` must not mutate its argument: the undefended arm of the same evaluation
    still uses it.
    """

    name: ClassVar[str]
    kind: ClassVar[DefenseKind]

    def wrap(self, learner: Learner[Any, Any]) -> Learner[Any, Any]:
        """Return the defended learner."""
        ...


@runtime_checkable
class Certifiable(Protocol):
    """A defense with a formal guarantee it can state for a fitted system.

    Examples: a DP epsilon, a certified bound, a certified coverage, a CKKS security
    level, the exactness of unlearning.
    """

    def certify(self, system: Any, task: Any) -> Metrics:
        """Return the guarantee's numbers for ``system`` trained on ``task``."""
        ...


@runtime_checkable
class InferenceAttack(Protocol[V_contra, G_co]):
    """A deployment-stage attack: look at the view, return a guess."""

    name: ClassVar[str]
    requires: ClassVar[frozenset[Capability]]

    def run(self, view: V_contra, rng: np.random.Generator) -> G_co:
        """Attack through ``view`` and return the guess the scenario judges."""
        ...


@runtime_checkable
class PoisoningAttack(Protocol[T]):
    """A training-stage attack: rewrite the task before the system is fitted."""

    name: ClassVar[str]
    requires: ClassVar[frozenset[Capability]]

    def poison(self, task: T, rng: np.random.Generator) -> T:
        """Return the poisoned task (a new object; ``task`` is left as it was)."""
        ...


class Scenario(Protocol[T, S, V_co, G]):
    """The challenger of a security game.

    Attributes
    ----------
    name : str
        Registry name.
    headline : tuple of (str, str)
        The utility metric and the attack-success metric shown in tables and plots.
    chance : Mapping[str, float]
        Success of an adversary that guesses without looking (for the contract checks
        and the report).
    """

    name: ClassVar[str]
    headline: ClassVar[tuple[str, str]]
    chance: ClassVar[Mapping[str, float]]

    @property
    def threat(self) -> ThreatModel:
        """The threat model the harness enforces."""
        ...

    def setup(self, rng: np.random.Generator) -> T:
        """Draw the data, splits and secrets."""
        ...

    def learner(self) -> Learner[T, S]:
        """Return the undefended learner."""
        ...

    def utility(self, system: S, task: T) -> Metrics:
        """Measure what the system is for (accuracy, coverage, ...)."""
        ...

    def expose(self, system: S, task: T, known_defense: object | None) -> V_co:
        """Return the adversary's view; ``known_defense`` is set for adaptive runs."""
        ...

    def judge(self, system: S, task: T, guess: G | None) -> Metrics:
        """Score the attack (higher means a stronger attack)."""
        ...

    def random_guess(self, task: T, rng: np.random.Generator) -> G | None:
        """Return a guess made without looking at the system, or None if none fits."""
        ...
