"""Harness wiring of the reference pair: membership inference on digits."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier

from defenses.arrays import FloatArray
from defenses.checks import check_int, check_real
from defenses.data import Dataset, load_digits, stratified_split
from defenses.metrics import accuracy, membership_metrics
from defenses.oracle import QueryOracle
from defenses.reference.attacks import (
    LabelOnlyAttack,
    LossThresholdAttack,
    MembershipView,
)
from defenses.reference.defense import LabelOnly, ProbabilisticClassifier, Rounding
from defenses.registry import register, register_package
from defenses.threat import Budget, Capability, ThreatModel

register_package(
    attacks=[LossThresholdAttack, LabelOnlyAttack], defenses=[Rounding, LabelOnly]
)


@dataclass(frozen=True)
class MembershipTask:
    """Members (the training set), non-members, a test set, and the secret bits."""

    train: Dataset
    test: Dataset
    candidates: FloatArray
    labels: npt.NDArray[np.int64]
    is_member: npt.NDArray[np.bool_]


@dataclass(frozen=True)
class MLPLearner:
    """A one-hidden-layer MLP (scikit-learn), trained to overfit a little."""

    hidden: int = 64
    max_iter: int = 300
    alpha: float = 1e-4

    def fit(
        self, task: MembershipTask, rng: np.random.Generator
    ) -> ProbabilisticClassifier:
        """Train on ``task.train`` with a seed drawn from ``rng``."""
        model = MLPClassifier(
            hidden_layer_sizes=(self.hidden,),
            max_iter=self.max_iter,
            alpha=self.alpha,
            random_state=int(rng.integers(2**31 - 1)),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model.fit(task.train.X, task.train.y)
        fitted: ProbabilisticClassifier = model
        return fitted


@register("scenarios", "digits-membership")
@dataclass(frozen=True)
class DigitsMembership:
    """Membership inference against a digits classifier.

    Digits are split (stratified) into members, non-members and a test set. The
    adversary queries the deployed model on the shuffled union of members and an
    equal number of non-members, with their labels, and scores membership.

    Parameters
    ----------
    members : float
        Fraction of the data used for training (the members).
    queries : int or None
        Query budget; None means unlimited.
    """

    name: ClassVar[str] = "digits-membership"
    headline: ClassVar[tuple[str, str]] = ("accuracy", "auc")
    chance: ClassVar[Mapping[str, float]] = {"auc": 0.5, "advantage": 0.0}
    members: float = 0.1
    queries: int | None = None

    def __post_init__(self) -> None:
        check_real("DigitsMembership.members", self.members, 0.05, 0.45)
        if self.queries is not None:
            check_int("DigitsMembership.queries", self.queries, 1)

    @property
    def threat(self) -> ThreatModel:
        """Black-box scores and labels, with the data owner's label for candidates."""
        return ThreatModel.granting(
            "confidentiality",
            Capability.QUERY_SCORES,
            Capability.QUERY_LABEL,
            budget=Budget(queries=self.queries),
        )

    def setup(self, rng: np.random.Generator) -> MembershipTask:
        """Split digits into members, non-members and test; shuffle the candidates."""
        data = load_digits()
        rest = 1.0 - 2 * self.members
        train_i, out_i, test_i = stratified_split(
            data.y, [self.members, self.members, rest], rng
        )
        cand = np.concatenate([train_i, out_i])
        is_member = np.concatenate(
            [np.ones(train_i.size, bool), np.zeros(out_i.size, bool)]
        )
        order = rng.permutation(cand.size)
        return MembershipTask(
            train=data.subset(train_i),
            test=data.subset(test_i),
            candidates=data.X[cand[order]],
            labels=data.y[cand[order]],
            is_member=is_member[order],
        )

    def learner(self) -> MLPLearner:
        """The undefended target: a small MLP."""
        return MLPLearner()

    def utility(
        self, system: ProbabilisticClassifier, task: MembershipTask
    ) -> dict[str, float]:
        """Test accuracy of the deployed (possibly post-processed) outputs."""
        predicted = np.argmax(system.predict_proba(task.test.X), axis=1)
        return {"accuracy": accuracy(predicted, task.test.y)}

    def expose(
        self,
        system: ProbabilisticClassifier,
        task: MembershipTask,
        known_defense: object | None,
    ) -> MembershipView:
        """A query oracle on the deployed model and the labelled candidates."""
        oracle = QueryOracle.granted_by(system.predict_proba, self.threat)
        return MembershipView(oracle, task.candidates, task.labels)

    def judge(
        self,
        system: ProbabilisticClassifier,
        task: MembershipTask,
        guess: FloatArray | None,
    ) -> dict[str, float]:
        """AUC, advantage and TPR at low FPR of the membership scores."""
        if guess is None:
            raise ValueError("the membership game needs a guess")
        return membership_metrics(guess, task.is_member)

    def random_guess(
        self, task: MembershipTask, rng: np.random.Generator
    ) -> FloatArray:
        """Uniform random membership scores."""
        return rng.random(task.is_member.size)
