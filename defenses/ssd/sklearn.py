"""SSD for scikit-learn: a classifier whose probabilities pass through the shield."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt


class Shield(Protocol):
    """What the wrapper needs of a fitted shield (a ``StealthyShield``)."""

    @property
    def n_classes(self) -> int:
        """Number of classes of the fitted prototypes."""
        ...

    def __call__(self, probs: Any, inputs: Any = None) -> Any:
        """Defended probabilities."""
        ...


class _ProbabilisticModel(Protocol):
    def predict_proba(self, X: Any) -> Any:
        """Class probabilities."""
        ...


class ShieldedClassifier:
    """A scikit-learn-style classifier whose probabilities pass through SSD."""

    def __init__(self, model: _ProbabilisticModel, shield: Shield) -> None:
        self.model = model
        self.shield = shield

    @property
    def classes_(self) -> Any:
        """The wrapped classifier's ``classes_``."""
        return getattr(self.model, "classes_", np.arange(self.shield.n_classes))

    def predict_proba(self, X: Any) -> npt.NDArray[np.floating]:
        """Defended probabilities."""
        answers: npt.NDArray[np.floating] = self.shield(
            np.asarray(self.model.predict_proba(X)), inputs=X
        )
        return answers

    def predict(self, X: Any) -> Any:
        """Arg-max label of the defended probabilities, in ``classes_``."""
        return np.asarray(self.classes_)[np.argmax(self.predict_proba(X), axis=1)]
