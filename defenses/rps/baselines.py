r"""Baselines: plain split conformal prediction and a plain (bagged) ensemble.

* :class:`SplitConformalClassifier` - split conformal prediction with the THR / LAC
  score :math:`s(x, y) = p_y(x)` and the finite-sample rank
  :math:`j = \lfloor (n + 1)\alpha \rfloor` (Vovk et al., 2005; Sadinle et al.,
  2019): the set is :math:`\{y : p_y(x) \ge \tau\}` with :math:`\tau` the j-th
  smallest calibration score. It gives the same sets as MAPIE's
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
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from defenses.checks import check_int
from defenses.rps.defense import NotFittedError, proba_columns
from defenses.rps.partition import check_features
from defenses.rps.quantile import check_alpha, textbook_rank
from defenses.rps.scores import smoothed_scores, vote_counts

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class _Conformal:
    """Shared label encoding, calibration and set prediction of the baselines."""

    def __init__(self, alpha: float) -> None:
        self.alpha = check_alpha(alpha)
        self.threshold_: float | None = None
        self.fitted_ = False

    def _labels(
        self, X: npt.ArrayLike, y: npt.ArrayLike
    ) -> tuple[FloatArray, IntArray]:
        features = check_features(X)
        labels = np.asarray(y)
        if labels.shape != (features.shape[0],):
            raise ValueError(
                f"y must have shape ({features.shape[0]},), got {labels.shape}"
            )
        self.classes_, encoded = np.unique(labels, return_inverse=True)
        if self.classes_.size < 2:
            raise ValueError(
                f"fit needs at least 2 classes, got {self.classes_.tolist()}"
            )
        self.n_features_in_ = features.shape[1]
        return features, encoded.astype(np.int64)

    def _check_X(self, X: npt.ArrayLike) -> FloatArray:
        if not self.fitted_:
            raise NotFittedError(f"{type(self).__name__} is not fitted: call fit first")
        features = check_features(X)
        if features.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {features.shape[1]} features, fitted with {self.n_features_in_}"
            )
        return features

    def predict_scores(self, X: npt.ArrayLike) -> FloatArray:
        """Conformity scores, shape (n, K)."""
        raise NotImplementedError

    def calibrate(self, X: npt.ArrayLike, y: npt.ArrayLike) -> Any:
        """Threshold: the ``floor((n + 1) alpha)``-th smallest calibration score."""
        scores = self.predict_scores(X)
        labels = np.asarray(y)
        if labels.shape != (scores.shape[0],):
            raise ValueError(
                f"y must have shape ({scores.shape[0]},), got {labels.shape}"
            )
        unseen = np.setdiff1d(labels, self.classes_)
        if unseen.size:
            raise ValueError(
                f"labels {unseen.tolist()} were not seen at fit time "
                f"(classes: {self.classes_.tolist()})"
            )
        encoded = np.searchsorted(self.classes_, labels)
        n = labels.size
        rank = textbook_rank(n, self.alpha)
        if rank < 1:
            raise ValueError(
                f"{n} calibration points are too few for alpha={self.alpha}: "
                f"need at least {int(np.ceil(1 / self.alpha)) - 1}"
            )
        own = scores[np.arange(n), encoded]
        self.threshold_ = float(np.sort(own)[rank - 1])
        return self

    def predict_sets(self, X: npt.ArrayLike) -> BoolArray:
        """Prediction sets, boolean (n, K) with columns ``classes_``."""
        self._check_X(X)
        if self.threshold_ is None:
            raise NotFittedError(f"{type(self).__name__} is not calibrated")
        return np.asarray(self.predict_scores(X) >= self.threshold_)


class SplitConformalClassifier(_Conformal):
    """Plain split conformal prediction (THR / LAC) around one classifier.

    Parameters
    ----------
    estimator : scikit-learn classifier with ``predict_proba``
        Cloned and fitted on the whole training set.
    alpha : float
        Miscoverage level in (0, 1).
    """

    def __init__(self, estimator: Any, alpha: float = 0.1) -> None:
        super().__init__(alpha)
        if not hasattr(estimator, "predict_proba"):
            raise ValueError(f"estimator {estimator!r} has no predict_proba")
        self.estimator = estimator

    def fit(self, X: npt.ArrayLike, y: npt.ArrayLike) -> SplitConformalClassifier:
        """Fit a clone of the estimator on (X, y)."""
        features, encoded = self._labels(X, y)
        with threadpool_limits(limits=1):
            self.model_ = clone(self.estimator).fit(features, encoded)
        self.fitted_ = True
        self.threshold_ = None
        return self

    def predict_scores(self, X: npt.ArrayLike) -> FloatArray:
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
    alpha : float
        Miscoverage level in (0, 1).
    random_state : int
        Seed of the bootstrap resamples.
    """

    def __init__(
        self,
        estimator: Any,
        n_models: int = 20,
        alpha: float = 0.1,
        random_state: int = 0,
    ) -> None:
        super().__init__(alpha)
        check_int("n_models", n_models, 1)
        self.estimator = estimator
        self.n_models = n_models
        self.random_state = random_state

    def fit(self, X: npt.ArrayLike, y: npt.ArrayLike) -> EnsembleConformalClassifier:
        """Fit each model on a bootstrap resample of (X, y)."""
        features, encoded = self._labels(X, y)
        rng = np.random.default_rng(self.random_state)
        self.models_: list[Any] = []
        with threadpool_limits(limits=1):
            for i in range(self.n_models):
                rows = np.asarray(
                    rng.integers(0, features.shape[0], features.shape[0]),
                    dtype=np.int64,
                )
                model = clone(self.estimator)
                if "random_state" in model.get_params():
                    model.set_params(random_state=self.random_state * 7919 + i)
                if np.unique(encoded[rows]).size < 2:
                    rows = np.arange(features.shape[0], dtype=np.int64)
                self.models_.append(model.fit(features[rows], encoded[rows]))
        self.fitted_ = True
        self.threshold_ = None
        return self

    def predict_scores(self, X: npt.ArrayLike) -> FloatArray:
        """Softmax of the vote fractions."""
        features = self._check_X(X)
        predictions = np.stack([m.predict(features) for m in self.models_])
        votes = vote_counts(predictions, int(self.classes_.size))
        return smoothed_scores(votes, self.n_models)
