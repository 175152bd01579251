"""The rules every membership game plays by: the adversary's view, the judge, chance.

Three games ask "was this record trained on?": the reference game on digits
(:class:`defenses.reference.scenario.DigitsMembership`), S3T's canary audit of
deletions (:class:`defenses.s3t.scenario.CanaryDeletion`) and the federated
membership game (:class:`defense_suite.federated.scenario.FederatedMembership`).
Each draws its own candidates; :class:`MembershipRules` plays the rest the same way:

* **view** - a :class:`~defenses.oracle.QueryOracle` on the deployed model's
  ``predict_proba``, restricted to what the threat model grants, and the candidates
  with their labels (:class:`~defenses.reference.attacks.MembershipView`);
* **judge** - AUC, advantage and TPR at 1 % and 0.1 % FPR of the adversary's scores
  against the secret bits (:func:`defenses.metrics.membership_metrics`);
* **chance** - uniform random scores, the blind adversary.

A game mixes :class:`MembershipRules` in and says where its task keeps the candidates
(:meth:`MembershipRules.membership`); it may extend :meth:`~MembershipRules.judge` with
metrics of its own (S3T's flip gap, the federated per-group AUCs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import numpy as np

from defenses.arrays import BoolArray, FloatArray, IntArray
from defenses.metrics import membership_metrics
from defenses.oracle import QueryOracle
from defenses.reference.attacks import MembershipView
from defenses.reference.defense import ProbabilisticClassifier
from defenses.threat import ThreatModel

S = TypeVar("S", bound=ProbabilisticClassifier)
T = TypeVar("T")


@dataclass(frozen=True)
class Members:
    """What a membership task holds: the candidates, their labels, the secret bits.

    Attributes
    ----------
    candidates : array of shape (n, ...)
        The records the adversary scores.
    labels : int array of shape (n,)
        Their true labels (the adversary is given them).
    is_member : bool array of shape (n,)
        Which candidates were trained on (the judge's secret).
    """

    candidates: FloatArray
    labels: IntArray
    is_member: BoolArray


class MembershipRules(Generic[S, T]):
    """View, judge and chance of a membership game over systems ``S``, tasks ``T``.

    A mix-in for a scenario that defines ``name``, ``threat`` and :meth:`membership`.
    """

    name: ClassVar[str]

    @property
    def threat(self) -> ThreatModel:
        """The game's threat model (the scenario defines it)."""
        raise NotImplementedError

    def membership(self, task: T) -> Members:
        """The task's candidates, their labels and the secret bits."""
        raise NotImplementedError

    def expose(
        self, system: S, task: T, known_defense: object | None
    ) -> MembershipView:
        """The labelled candidates and an oracle on the model, as the threat grants."""
        held = self.membership(task)
        oracle = QueryOracle.granted_by(system.predict_proba, self.threat)
        return MembershipView(oracle, held.candidates, held.labels)

    def judge(self, system: S, task: T, guess: FloatArray | None) -> dict[str, float]:
        """AUC, advantage and TPR at low FPR of the adversary's membership scores."""
        if guess is None:
            raise ValueError(f"the {self.name} game needs the adversary's scores")
        return membership_metrics(guess, self.membership(task).is_member)

    def random_guess(self, task: T, rng: np.random.Generator) -> FloatArray:
        """Uniform random membership scores: the blind adversary."""
        return rng.random(self.membership(task).is_member.size)
