"""Output post-processing defenses of the reference pair: rounding and label-only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from defenses.api import DefenseKind, Learner
from defenses.arrays import FloatArray
from defenses.checks import check_int


class ProbabilisticClassifier(Protocol):
    """A fitted classifier that answers class probabilities."""

    def predict_proba(self, X: FloatArray) -> FloatArray:
        """Return probabilities of shape (n, K)."""
        ...


def round_scores(scores: FloatArray, decimals: int) -> FloatArray:
    """Round each score to ``decimals`` places (ties of the rounding stay ties)."""
    return np.asarray(np.round(scores, decimals), dtype=np.float64)


def one_hot_argmax(scores: FloatArray) -> FloatArray:
    """Replace each score vector by the one-hot vector of its arg-max."""
    s = np.asarray(scores, dtype=np.float64)
    out = np.zeros_like(s)
    out[np.arange(s.shape[0]), np.argmax(s, axis=1)] = 1.0
    return out


class ScorePostProcessor:
    """A defense that maps each score row the fitted system answers to another.

    Subclasses write ``__call__``; the kind and :meth:`wrap` are shared.
    """

    kind: ClassVar[DefenseKind] = DefenseKind.POSTPROCESSOR

    def __call__(self, scores: FloatArray) -> FloatArray:
        """The answered scores for the system's ``scores``, shape (n, K)."""
        raise NotImplementedError

    def wrap(
        self, learner: Learner[Any, ProbabilisticClassifier]
    ) -> PostProcessedLearner:
        """Return a learner whose fitted system answers through this defense."""
        return PostProcessedLearner(learner, self)


@dataclass(frozen=True)
class PostProcessed:
    """A fitted classifier whose outputs pass through a post-processor."""

    inner: ProbabilisticClassifier
    defense: ScorePostProcessor

    def predict_proba(self, X: FloatArray) -> FloatArray:
        """Post-processed probabilities."""
        return self.defense(self.inner.predict_proba(X))


@dataclass(frozen=True)
class PostProcessedLearner:
    """Fit the inner learner, then post-process the fitted system's outputs."""

    inner: Learner[Any, ProbabilisticClassifier]
    defense: ScorePostProcessor

    def fit(self, task: Any, rng: np.random.Generator) -> PostProcessed:
        """Fit the inner learner and wrap the result."""
        return PostProcessed(self.inner.fit(task, rng), self.defense)


@dataclass(frozen=True)
class Rounding(ScorePostProcessor):
    """Round the output scores to ``decimals`` places.

    Parameters
    ----------
    decimals : int
        Decimal places kept, >= 0.
    """

    name: ClassVar[str] = "rounding"
    decimals: int = 1

    def __post_init__(self) -> None:
        check_int("Rounding.decimals", self.decimals, 0)

    def __call__(self, scores: FloatArray) -> FloatArray:
        """Rounded scores."""
        return round_scores(scores, self.decimals)


@dataclass(frozen=True)
class LabelOnly(ScorePostProcessor):
    """Answer only the predicted label, as a one-hot score vector."""

    name: ClassVar[str] = "label-only"

    def __call__(self, scores: FloatArray) -> FloatArray:
        """One-hot arg-max scores."""
        return one_hot_argmax(scores)
