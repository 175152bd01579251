r"""Membership-inference attacks of the reference pair.

* Loss threshold (Yeom et al., 2018), on the logit scale of Carlini et al. (2022):
  members have lower loss; the score is
  :math:`\log p_\theta(y \mid x) - \log(1 - p_\theta(y \mid x))`.
* Label only (gap attack, Choquette-Choo et al., 2021): the score is 1 when the
  predicted label is right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_real
from defenses.metrics import true_class_logit
from defenses.oracle import QueryOracle
from defenses.threat import Capability


@dataclass(frozen=True)
class MembershipView:
    """What a membership adversary gets: an oracle and labelled candidates."""

    oracle: QueryOracle
    candidates: FloatArray
    labels: npt.NDArray[np.int64]


@dataclass(frozen=True)
class LossThresholdAttack:
    """Score each candidate by the logit of its true-class probability.

    Parameters
    ----------
    floor : float
        Probabilities are clipped to [floor, 1 - floor] before the logit, in
        [1e-15, 0.5) (below 1e-15, 1 - floor rounds to 1).
    """

    name: ClassVar[str] = "loss-mia"
    requires: ClassVar[frozenset[Capability]] = frozenset({Capability.QUERY_SCORES})
    floor: float = 1e-15

    def __post_init__(self) -> None:
        check_real(
            f"{type(self).__name__}.floor", self.floor, 1e-15, 0.5, open_high=True
        )

    def run(self, view: MembershipView, rng: np.random.Generator) -> FloatArray:
        """Membership scores (higher means more likely a member)."""
        return true_class_logit(view.oracle(view.candidates), view.labels, self.floor)


@dataclass(frozen=True)
class LabelOnlyAttack:
    """Score 1 when the target labels the candidate correctly, else 0."""

    name: ClassVar[str] = "label-only-mia"
    requires: ClassVar[frozenset[Capability]] = frozenset({Capability.QUERY_LABEL})

    def run(self, view: MembershipView, rng: np.random.Generator) -> FloatArray:
        """Membership scores in {0, 1}."""
        answers = np.asarray(view.oracle(view.candidates))
        predicted = answers if answers.ndim == 1 else np.argmax(answers, axis=1)
        return np.asarray(predicted == view.labels, dtype=np.float64)
