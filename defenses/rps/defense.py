r"""The RPS conformal classifier: fit, conformalize, predict sets, certify.

Scholten & Günnemann, "Provably Reliable Conformal Prediction Sets in the Presence
of Data Poisoning", ICLR 2025 (Alg. 1 and 2). A scikit-learn meta-estimator that
speaks MAPIE 1.x's vocabulary::

    rps = ReliableConformalClassifier(LogisticRegression(), n_train_parts=20,
                                      n_calib_parts=10, confidence_level=0.9)
    rps.fit(X_train, y_train).conformalize(X_conf, y_conf)
    y_pred, y_set = rps.predict_set(X_test)   # y_set: bool (n, K, 1), as MAPIE's
    cert = rps.certify(X_test)                # radii per point and class

Training: the data are hash-partitioned into :math:`k_t` parts
(:mod:`defenses.rps.partition`), one clone of ``estimator`` per part; the score of
class :math:`y` is :math:`s(x, y) = \operatorname{softmax}(\pi(x))_y` with
:math:`\pi_y(x) = \#\{i : f_i(x) = y\} / k_t`. Conformalization: the calibration
data are hash-partitioned into :math:`k_c` parts with thresholds :math:`\tau_i`
(:mod:`defenses.rps.calibration`); the set keeps :math:`y` when more than
:math:`\hat\tau(\alpha)` part sets :math:`\{y : s(x, y) \ge \tau_i\}` hold it,
:math:`\alpha = 1 - \text{confidence\_level}`.

With ``n_train_parts = 1`` the score is the single model's ``predict_proba`` (THR /
LAC); with ``n_calib_parts = 1`` the set is the split-conformal set; both at 1 give
plain split conformal prediction, the same sets as MAPIE's
``SplitConformalClassifier(conformity_score="lac")`` on the same model. As in MAPIE,
``confidence_level`` may be a list (sets ``(n, K, L)``, :mod:`defenses.rps.levels`),
``prefit=True`` conformalizes a fitted model directly and ``conformity_score`` is
``"lac"`` (:mod:`defenses.rps.conformity`). ``conformalize`` warns
(:class:`~defenses.rps.advice.EmptyCertificateWarning`) when the partition
certifies nothing; :func:`~defenses.rps.advice.suggest_parts` proposes one.

Part classifiers trained elsewhere (e.g. a sharded unlearning ensemble) plug in
through :meth:`ReliableConformalClassifier.from_voter` and a
:class:`~defenses.rps.ensemble.PartVoter`, whose parts may abstain.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.exceptions import NotFittedError as NotFittedError
from sklearn.linear_model import LogisticRegression
from sklearn.utils import get_tags
from sklearn.utils.validation import check_is_fitted, validate_data

from defenses.arrays import BoolArray, FloatArray, IntArray
from defenses.checks import check_int
from defenses.rps.advice import warn_if_empty
from defenses.rps.certificate import Certificate, ScoreGeometry, certify_batch
from defenses.rps.conformity import PREFIT_FIT_MESSAGE, PrefitPart
from defenses.rps.ensemble import PartVoter, check_estimator, train_parts
from defenses.rps.entries import point_sets
from defenses.rps.inputs import check_inputs, encode_labels, encode_with
from defenses.rps.levels import LEVEL_ATTRIBUTES, calibrate_levels, pick_level, store
from defenses.rps.partition import n_rows, partition
from defenses.rps.parts import FittedParts, warn_if_degenerate
from defenses.rps.quantile import QuantileMode
from defenses.rps.scores import vote_counts
from defenses.rps.settings import Settings, check_settings, shallow_params
from defenses.rps.voting import adopt_voter, voter_parts

logger = logging.getLogger(__name__)


class NotConformalizedError(NotFittedError):  # type: ignore[misc]
    """The classifier is fitted but :meth:`conformalize` was not called."""


class ReliableConformalClassifier(ClassifierMixin, BaseEstimator):  # type: ignore[misc]
    r"""Reliable prediction sets under training and calibration poisoning.

    Parameters
    ----------
    estimator : scikit-learn classifier, TorchPartClassifier, callable or None
        Base learner, cloned per training part (None: ``LogisticRegression()``);
        a callable is a torch model factory ``(n_features, n_classes) -> Module``.
        It must be deterministic given its ``random_state`` (seeded per part). It
        receives the features as given (DataFrame, sparse matrix, NaN).
    n_train_parts : int
        ``k_t``, number of hash parts of the training data (1: no training defense).
    n_calib_parts : int
        ``k_c``, number of hash parts of the calibration data (1: no majority).
    confidence_level : float or list of float
        Target coverage :math:`1 - \alpha` in (0, 1); a list gives one set per level.
    quantile : {"exact", "official", "markov"}
        Per-part rank rule (see :mod:`defenses.rps.quantile`).
    softmax : bool
        Smooth vote fractions with a softmax (the paper's default) or use them raw.
    random_state : int
        Base seed of the per-part training, in [0, 2**32): part ``i`` gets
        ``(random_state * 7919 + i) mod 2**32``.
    n_jobs : int or None
        Parallel training jobs (joblib; None or 1: one, -1: all cores; not 0).
    conformity_score : "lac" or mapie's LACConformityScore()
        MAPIE's name of the threshold score; the others are refused.
    prefit : bool
        ``estimator`` is fitted: skip :meth:`fit`, call :meth:`conformalize`
        (needs ``n_train_parts=1``).

    Attributes
    ----------
    classes_ : ndarray of shape (K,)
        The labels seen in :meth:`fit`, sorted; set columns follow them.
    estimators_ : list
        The part classifiers (trained on labels encoded ``0..K-1``).
    train_part_sizes_, calib_part_sizes_ : int arrays
        Points per training / calibration part.
    tau_hat_ : int
        The majority threshold :math:`\hat\tau(\alpha, k_c)` (after
        :meth:`conformalize`).
    thresholds_, ranks_, guard_, miscoverage_bound_
        Per-part thresholds and ranks, the deletion guard, and the exact
        miscoverage bound of the majority set (a leading axis per level when
        ``confidence_level`` is a list).
    """

    def __init__(
        self,
        estimator: Any = None,
        n_train_parts: int = 10,
        n_calib_parts: int = 10,
        confidence_level: float = 0.9,
        quantile: QuantileMode = "exact",
        softmax: bool = True,
        random_state: int = 0,
        n_jobs: int | None = None,
        conformity_score: Any = "lac",
        prefit: bool = False,
    ) -> None:
        self.estimator = estimator
        self.n_train_parts = n_train_parts
        self.n_calib_parts = n_calib_parts
        self.confidence_level = confidence_level
        self.quantile = quantile
        self.softmax = softmax
        self.random_state = random_state
        self.n_jobs = n_jobs
        self.conformity_score = conformity_score
        self.prefit = prefit

    # ------------------------------------------------------------- parameters
    def _settings(self) -> Settings:
        """The parameters, validated (every message names its parameter)."""
        return check_settings(shallow_params(self))

    def _base(self) -> Any:
        return LogisticRegression() if self.estimator is None else self.estimator

    def __sklearn_tags__(self) -> Any:
        """Classifier tags; NaN and sparse support are the base estimator's."""
        tags = super().__sklearn_tags__()
        base = self._base()
        if isinstance(base, BaseEstimator):
            inner = get_tags(base).input_tags
            tags.input_tags.allow_nan = inner.allow_nan
            tags.input_tags.sparse = inner.sparse
            tags.input_tags.categorical = inner.categorical
            tags.input_tags.string = inner.string
        return tags

    def __sklearn_is_fitted__(self) -> bool:
        """Fitted once :meth:`fit` ran (or the instance came from a voter)."""
        return hasattr(self, "estimators_") or hasattr(self, "voter_")

    @classmethod
    def from_voter(
        cls,
        voter: PartVoter,
        classes: npt.ArrayLike,
        n_features: int,
        n_calib_parts: int = 10,
        confidence_level: float = 0.9,
        quantile: QuantileMode = "exact",
        softmax: bool = True,
    ) -> ReliableConformalClassifier:
        """RPS on part classifiers trained elsewhere; already fitted.

        ``voter.part_votes(X)`` gives a class index into ``classes`` (sorted,
        distinct) per part and point, or -1 when a part abstains; see
        :mod:`defenses.rps.voting`. The result is ready for :meth:`conformalize`
        (:meth:`fit` does not apply); the other parameters are the constructor's.
        """
        k_t = voter_parts(voter)
        model = cls(None, k_t, n_calib_parts, confidence_level, quantile, softmax)
        return adopt_voter(model, voter, classes, n_features)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ fitting
    def fit(self, X: Any, y: Any) -> ReliableConformalClassifier:
        """Train one clone of ``estimator`` per hash part of (X, y).

        ``X`` reaches the part estimators untouched (a list becomes an array);
        labels of any type are encoded against the sorted ``classes_``.
        """
        if hasattr(self, "voter_"):
            raise ValueError(
                "this classifier was built from a voter (from_voter): its parts are "
                "trained elsewhere, so fit does not apply; call conformalize"
            )
        settings = self._settings()
        if settings.prefit:
            raise ValueError(PREFIT_FIT_MESSAGE)
        base = self._base()
        check_estimator(base)
        features = check_inputs(X)
        validate_data(self, features, reset=True, skip_check_array=True)
        n = n_rows(features)
        classes, encoded = encode_labels(y, n, type(self).__name__)
        if classes.size < 2:
            raise ValueError(
                f"fit needs at least 2 classes in y, got one class {classes.tolist()}"
            )
        if settings.k_t > n:
            raise ValueError(
                f"n_train_parts={settings.k_t} exceeds the number of training "
                f"samples (n_samples = {n})"
            )
        models, parts = train_parts(
            base,
            features,
            encoded,
            settings.k_t,
            int(classes.size),
            settings.random_state,
            settings.n_jobs,
        )
        for name in LEVEL_ATTRIBUTES:
            self.__dict__.pop(name, None)
        self.classes_ = classes
        self.estimators_ = models
        self.train_part_sizes_ = np.array([p.size for p in parts], dtype=np.int64)
        self._parts = FittedParts(models, None, int(classes.size))
        return self

    @property
    def n_classes(self) -> int:
        """Number of classes seen at fit time."""
        check_is_fitted(self)
        return int(self.classes_.size)

    def _fitted_parts(self, settings: Settings | None = None) -> int:
        """``k_t`` of the fitted ensemble (refusing a changed ``n_train_parts``)."""
        check_is_fitted(self)
        k_t = (settings or self._settings()).k_t
        fitted = self._parts.n_parts
        if not self._voter and k_t != fitted:
            raise ValueError(
                f"n_train_parts={k_t} was set after fit with {fitted} parts: call fit "
                "again"
            )
        return int(fitted)

    @property
    def _voter(self) -> bool:
        return hasattr(self, "voter_")

    def _check_X(self, X: Any) -> Any:
        check_is_fitted(self)
        features = check_inputs(X)
        validate_data(self, features, reset=False, skip_check_array=True)
        return features

    def predict_votes(self, X: Any) -> IntArray:
        """Votes of the part classifiers, shape (n, K) (the models' work).

        With a voter, rows sum to ``n_train_parts`` minus the abstentions.
        """
        features = self._check_X(X)
        votes = self._parts.votes(features, self._fitted_parts())
        return vote_counts(votes, self.n_classes, abstain=self._parts.abstain)

    def _geometry(self, features: Any, votes: IntArray | None = None) -> ScoreGeometry:
        settings = self._settings()
        self._fitted_parts(settings)
        return self._parts.geometry(features, settings.softmax, votes)

    def predict_scores(self, X: Any) -> FloatArray:
        """Conformity scores s(x, y), shape (n, K), columns ``classes_``."""
        geometry = self._geometry(self._check_X(X))
        return geometry.score()[geometry.index]

    def predict(self, X: Any) -> npt.NDArray[Any]:
        """Point predictions: the class of highest score (most votes) per point."""
        best = self.predict_scores(X).argmax(axis=1)
        return np.asarray(self.classes_[best])

    def _radius(
        self, max_train_radius: int | None, settings: Settings | None = None
    ) -> int:
        k_t = self._fitted_parts(settings)
        largest = 0 if self._parts.single else k_t
        radius = largest if max_train_radius is None else max_train_radius
        return min(check_int("max_train_radius", radius, 0), largest)

    # ------------------------------------------------------------ conformalizing
    def conformalize(
        self, X: Any, y: Any, max_train_radius: int | None = None
    ) -> ReliableConformalClassifier:
        """Compute each calibration part's threshold and its worst-case range.

        ``max_train_radius`` caps the training radius the thresholds' worst case is
        computed for (default ``n_train_parts``; 0 skips it, leaving only
        calibration-side certificates). Warns (:class:`DegeneratePartsWarning`)
        when the part models' votes barely depend on the input, and
        (:class:`~defenses.rps.advice.EmptyCertificateWarning`) when no calibration
        point's set is certified against one poisoned point. With ``prefit=True``
        the fitted ``estimator`` becomes the one training part here.
        """
        if self._settings().prefit:
            self._adopt_prefit(X)
        features = self._check_X(X)
        labels = encode_with(self.classes_, y, n_rows(features), type(self).__name__)
        votes = None
        k_t = self._fitted_parts()
        if not self._parts.single:
            votes = self._parts.votes(features, k_t)
            sizes = getattr(self, "train_part_sizes_", None)
            warn_if_degenerate(votes, labels, None if sizes is None else sizes.mean())
        geometry = self._geometry(features, votes)
        return self.conformalize_geometry(features, labels, geometry, max_train_radius)

    def _adopt_prefit(self, X: Any) -> None:
        """Take the fitted ``estimator`` as the one part (MAPIE's ``prefit``)."""
        part = PrefitPart(self._base())
        validate_data(self, check_inputs(X), reset=True, skip_check_array=True)
        for name in LEVEL_ATTRIBUTES:
            self.__dict__.pop(name, None)
        self.classes_ = part.labels
        self.estimators_ = [part.model]
        self._parts = FittedParts([part], None, int(part.labels.size))

    def geometry(self, X: Any) -> ScoreGeometry:
        """Scores and bound machinery of ``X`` (the models' predictions, reusable)."""
        return self._geometry(self._check_X(X))

    def conformalize_geometry(
        self,
        features: Any,
        labels: IntArray,
        geometry: ScoreGeometry,
        max_train_radius: int | None = None,
    ) -> ReliableConformalClassifier:
        """:meth:`conformalize` from precomputed scores (``labels`` encoded 0..K-1).

        Lets studies conformalize on many splits without re-running the models.
        """
        settings = self._settings()
        n = n_rows(features)
        if settings.k_c > n:
            raise ValueError(
                f"n_calib_parts={settings.k_c} exceeds the number of calibration "
                f"samples (n_samples = {n})"
            )
        parts = partition(features, labels, settings.k_c)
        entries = geometry.index[np.arange(n), labels]
        radius = self._radius(max_train_radius)
        levels = calibrate_levels(parts, entries, geometry, settings, radius)
        store(self, levels, settings.several)
        sizes = levels[0].sizes
        trained = getattr(self, "train_part_sizes_", None)
        for alpha, level in zip(settings.alphas, levels, strict=True):
            logger.info(
                "conformalized %d parts (sizes %d..%d), tau_hat=%d, miscoverage %.4f",
                settings.k_c,
                sizes.min(),
                sizes.max(),
                level.part_thresholds.tau_hat,
                level.miscoverage_bound,
            )
            warn_if_empty(
                level.part_thresholds,
                geometry,
                radius >= 1 and not self._parts.single,
                (0 if trained is None else int(trained.sum()), n, self.n_classes),
                1.0 - alpha,
            )
        return self

    def _check_conformalized(self) -> None:
        check_is_fitted(self)
        if not hasattr(self, "part_thresholds_"):
            raise NotConformalizedError(
                f"This {type(self).__name__} is fitted but not conformalized: call "
                "conformalize(X_conf, y_conf) first"
            )

    # --------------------------------------------------------------- predicting
    def predict_set(self, X: Any) -> tuple[npt.NDArray[Any], BoolArray]:
        """Point predictions and majority prediction sets, as MAPIE 1.x returns them.

        Returns
        -------
        y_pred : ndarray of shape (n,)
            :meth:`predict`.
        y_pred_set : bool ndarray of shape (n, K, L)
            The sets, columns ``classes_``, one per confidence level (L = 1 for a
            float). A class is in more than ``tau_hat_`` part sets exactly when its
            score reaches the ``(tau_hat_ + 1)``-th smallest part threshold.
        """
        self._check_conformalized()
        geometry = self._geometry(self._check_X(X))
        cuts = np.array([t.cut for t in self.level_thresholds_])
        scores = np.ascontiguousarray(geometry.score(), dtype=np.float64)
        best, sets = point_sets(scores, geometry.index, cuts)
        return self.classes_[best], sets

    def certify(
        self,
        X: Any,
        max_train_radius: int | None = None,
        confidence_level: float | None = None,
    ) -> Certificate:
        """Certified radii per point and class (the sets are included).

        Parameters
        ----------
        X : array-like, sparse matrix or DataFrame of n rows
            Test points.
        max_train_radius : int or None
            Largest training radius examined (default and at most
            ``n_train_parts``; radii are capped there, which is sound).
        confidence_level : float or None
            The level to certify, one of those conformalized (None: the only one).

        Returns
        -------
        Certificate
            The sets (``Certificate.sets`` equals that level's
            ``predict_set(X)[1][:, :, l]``) and the radii.
        """
        self._check_conformalized()
        settings = self._settings()
        thresholds = pick_level(
            self.level_thresholds_, settings.alphas, settings.several, confidence_level
        )
        features = self._check_X(X)
        radius = min(self._radius(max_train_radius, settings), thresholds.radius)
        return certify_batch(self._geometry(features), thresholds, radius)
