r"""Baselines: plain split conformal prediction and a plain (bagged) ensemble.

* :class:`SplitConformalClassifier` - split conformal prediction with the THR / LAC
  score :math:`s(x, y) = p_y(x)` and the finite-sample rank
  :math:`j = \lfloor (n + 1)\alpha \rfloor` (Vovk et al., 2005; Sadinle et al.,
  2019): the set is :math:`\{y : p_y(x) \ge \tau\}` with :math:`\tau` the j-th
  smallest calibration score, :math:`\alpha = 1 - \text{confidence\_level}`. It
  gives the same sets as MAPIE's
  ``SplitConformalClassifier(conformity_score="lac", prefit=True)``.
* :class:`EnsembleConformalClassifier` - ``n_models`` classifiers trained on
  bootstrap resamples of the *whole* training set (no partitioning), with the same
  vote-softmax score as RPS and one split-conformal threshold. It shows that voting
  alone does not bound the influence of a poisoned point: every model sees it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.base import clone
from sklearn.utils import _safe_indexing
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from defenses.arrays import BoolArray, FloatArray, IntArray
from defenses.checks import check_int, check_real
from defenses.rps.defense import NotFittedError
from defenses.rps.ensemble import proba_columns
from defenses.rps.inputs import check_inputs, encode_labels, encode_with
from defenses.rps.partition import n_rows
from defenses.rps.quantile import textbook_rank
from defenses.rps.scores import smoothed_scores, vote_counts


class _Conformal:
    """Shared label encoding, conformalization and set prediction of the baselines."""

    def __init__(self, confidence_level: float) -> None:
        self.confidence_level = check_real(
            "confidence_level",
            confidence_level,
            0.0,
            1.0,
            open_low=True,
            open_high=True,
        )
        self.alpha = 1.0 - self.confidence_level
        self.threshold_: float | None = None
        self.fitted_ = False

    def _labels(self, X: Any, y: Any) -> tuple[Any, IntArray]:
        features = check_inputs(X)
        self.classes_, encoded = encode_labels(y, n_rows(features), type(self).__name__)
        if self.classes_.size < 2:
            raise ValueError(
                f"fit needs at least 2 classes in y, got {self.classes_.tolist()}"
            )
        self.n_features_in_ = features.shape[1]
        return features, encoded

    def _check_X(self, X: Any) -> Any:
        if not self.fitted_:
            raise NotFittedError(f"{type(self).__name__} is not fitted: call fit first")
        features = check_inputs(X)
        if features.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {features.shape[1]} features, fitted with {self.n_features_in_}"
            )
        return features

    def predict_scores(self, X: Any) -> FloatArray:
        """Conformity scores, shape (n, K)."""
        raise NotImplementedError

    def conformalize(self, X: Any, y: Any) -> Any:
        """Threshold: the ``floor((n + 1) alpha)``-th smallest conformity score."""
        scores = self.predict_scores(X)
        n = scores.shape[0]
        encoded = encode_with(self.classes_, y, n, type(self).__name__)
        rank = textbook_rank(n, self.alpha)
        if rank < 1:
            raise ValueError(
                f"{n} conformalization points are too few for confidence_level="
                f"{self.confidence_level}: need at least "
                f"{int(np.ceil(1 / self.alpha - 1e-9)) - 1}"
            )
        own = scores[np.arange(n), encoded]
        self.threshold_ = float(np.sort(own)[rank - 1])
        return self

    def predict(self, X: Any) -> npt.NDArray[Any]:
        """The class of highest score per point."""
        return np.asarray(self.classes_[self.predict_scores(X).argmax(axis=1)])

    def predict_set(self, X: Any) -> tuple[npt.NDArray[Any], BoolArray]:
        """Point predictions and sets (n, K, 1), columns ``classes_`` (as MAPIE)."""
        self._check_X(X)
        if self.threshold_ is None:
            raise NotFittedError(f"{type(self).__name__} is not conformalized")
        scores = self.predict_scores(X)
        sets = np.asarray(scores >= self.threshold_)
        return self.classes_[scores.argmax(axis=1)], sets[:, :, None]


class SplitConformalClassifier(_Conformal):
    r"""Plain split conformal prediction (THR / LAC) around one classifier.

    Parameters
    ----------
    estimator : scikit-learn classifier with ``predict_proba``
        Cloned and fitted on the whole training set.
    confidence_level : float
        Target coverage :math:`1 - \alpha` in (0, 1).
    """

    def __init__(self, estimator: Any, confidence_level: float = 0.9) -> None:
        super().__init__(confidence_level)
        if not hasattr(estimator, "predict_proba"):
            raise TypeError(f"estimator {estimator!r} has no predict_proba")
        self.estimator = estimator

    def fit(self, X: Any, y: Any) -> SplitConformalClassifier:
        """Fit a clone of the estimator on (X, y)."""
        features, encoded = self._labels(X, y)
        with threadpool_limits(limits=1):
            self.model_ = clone(self.estimator).fit(features, encoded)
        self.fitted_ = True
        self.threshold_ = None
        return self

    def predict_scores(self, X: Any) -> FloatArray:
        """The model's class probabilities."""
        return proba_columns(self.model_, self._check_X(X), int(self.classes_.size))


class EnsembleConformalClassifier(_Conformal):
    """Vote-softmax split conformal prediction over a bagged ensemble.

    Parameters
    ----------
    estimator : scikit-learn classifier
        Cloned per model; ``random_state`` (if any) is set per model.
    n_models : int
        Ensemble size.
    confidence_level : float
        Target coverage in (0, 1).
    random_state : int
        Seed of the bootstrap resamples.
    """

    def __init__(
        self,
        estimator: Any,
        n_models: int = 20,
        confidence_level: float = 0.9,
        random_state: int = 0,
    ) -> None:
        super().__init__(confidence_level)
        check_int("n_models", n_models, 1)
        self.estimator = estimator
        self.n_models = n_models
        self.random_state = check_int("random_state", random_state, 0)

    def fit(self, X: Any, y: Any) -> EnsembleConformalClassifier:
        """Fit each model on a bootstrap resample of (X, y)."""
        features, encoded = self._labels(X, y)
        n = n_rows(features)
        rng = np.random.default_rng(self.random_state)
        self.models_: list[Any] = []
        with threadpool_limits(limits=1):
            for i in range(self.n_models):
                rows = np.asarray(rng.integers(0, n, n), dtype=np.int64)
                model = clone(self.estimator)
                if "random_state" in model.get_params():
                    model.set_params(random_state=self.random_state * 7919 + i)
                if np.unique(encoded[rows]).size < 2:
                    rows = np.arange(n, dtype=np.int64)
                part = _safe_indexing(features, rows)
                self.models_.append(model.fit(part, encoded[rows]))
        self.fitted_ = True
        self.threshold_ = None
        return self

    def predict_scores(self, X: Any) -> FloatArray:
        """Softmax of the vote fractions."""
        features = self._check_X(X)
        predictions = np.stack([m.predict(features) for m in self.models_])
        votes = vote_counts(predictions, int(self.classes_.size))
        return smoothed_scores(votes, self.n_models)
