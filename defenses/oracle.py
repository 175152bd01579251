"""Black-box access to a deployed system, budgeted and counted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_int
from defenses.cost import count
from defenses.threat import Capability, ThreatModel, ThreatModelViolation


class QueryBudgetExceeded(RuntimeError):
    """The adversary asked for more answers than its budget allows."""


@dataclass(slots=True)
class QueryOracle:
    """Answer queries to a deployed system, within a budget.

    Parameters
    ----------
    predict : callable
        Maps an array of inputs, shape ``(n, ...)``, to scores of shape ``(n, K)``.
    budget : int or None
        Total number of inputs that may be submitted; None means unlimited.
    labels_only : bool
        Answer the arg-max label (shape ``(n,)``) instead of the scores.

    Every answered input is added to the ``queries`` cost counter.
    """

    predict: Callable[[FloatArray], npt.NDArray[np.floating]]
    budget: int | None = None
    labels_only: bool = False
    used: int = 0

    def __post_init__(self) -> None:
        if self.budget is not None:
            self.budget = check_int("QueryOracle.budget", self.budget, 0)

    @classmethod
    def granted_by(
        cls,
        predict: Callable[[FloatArray], npt.NDArray[np.floating]],
        threat: ThreatModel,
    ) -> QueryOracle:
        """Build the oracle that ``threat`` allows: scores, labels, or nothing."""
        if threat.grants(Capability.QUERY_SCORES):
            labels_only = False
        elif threat.grants(Capability.QUERY_LABEL):
            labels_only = True
        else:
            raise ThreatModelViolation(
                "a query oracle needs 'query-scores' or 'query-label', which the "
                "threat model does not grant"
            )
        return cls(predict, budget=threat.budget.queries, labels_only=labels_only)

    @property
    def remaining(self) -> int | None:
        """Queries left, or None if unlimited."""
        return None if self.budget is None else self.budget - self.used

    def __call__(self, x: npt.ArrayLike) -> npt.NDArray[np.generic]:
        """Answer a batch of queries, shape ``(n, ...)``."""
        raw = np.asarray(x)
        if raw.dtype.kind not in "biuf":
            raise TypeError(
                f"queries must be real numbers, got an array of dtype {raw.dtype}"
            )
        batch = raw.astype(np.float64)
        if batch.ndim < 1 or batch.shape[0] == 0:
            raise ValueError(
                "queries must be a non-empty batch of shape (n, ...), "
                f"got {batch.shape}"
            )
        if not np.all(np.isfinite(batch)):
            raise ValueError("queries must be finite (found NaN or inf)")
        n = int(batch.shape[0])
        if self.budget is not None and self.used + n > self.budget:
            raise QueryBudgetExceeded(
                f"{n} more queries would exceed the budget of {self.budget} "
                f"({self.used} used)"
            )
        self.used += n
        count("queries", n)
        scores = np.asarray(self.predict(batch))
        if scores.ndim != 2 or scores.shape[0] != n:
            raise ValueError(
                f"the system answered shape {scores.shape} to {n} queries; "
                "expected (n, K)"
            )
        if self.labels_only:
            return np.asarray(np.argmax(scores, axis=1), dtype=np.int64)
        return scores
