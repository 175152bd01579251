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
from defenses.metrics import accuracy
from defenses.reference.attacks import (
    LabelOnlyAttack,
    LossThresholdAttack,
)
from defenses.reference.defense import LabelOnly, ProbabilisticClassifier, Rounding
from defenses.reference.membership import Members, MembershipRules
from defenses.registry import register, register_package
from defenses.threat import QUERYING, Budget, ThreatModel

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
class DigitsMembership(MembershipRules[ProbabilisticClassifier, MembershipTask]):
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
            *QUERYING,
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

    def membership(self, task: MembershipTask) -> Members:
        """The shuffled members and non-members, their labels and the secret bits."""
        return Members(task.candidates, task.labels, task.is_member)
