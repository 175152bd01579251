"""The RPS conformal classifier: fit, calibrate, predict sets, certify.

Scholten & Günnemann, "Provably Reliable Conformal Prediction Sets in the Presence
of Data Poisoning", ICLR 2025 (Alg. 1 and 2). Usable the way MAPIE, TorchCP and
crepes users expect::

    rps = ReliableConformalClassifier(LogisticRegression(), 20, 10, alpha=0.1)
    rps.fit(X_train, y_train).calibrate(X_cal, y_cal)
    sets = rps.predict_sets(X_test)            # boolean (n, K)
    cert = rps.certify(X_test)                 # radii per point and class

With ``n_train_parts = 1`` the score is the single model's ``predict_proba`` (THR /
LAC); with ``n_calib_parts = 1`` the set is the split-conformal set; both at 1 give
plain split conformal prediction (with the chosen rank rule).

Part classifiers trained elsewhere (e.g. a sharded unlearning ensemble) plug in
through :meth:`ReliableConformalClassifier.from_voter` and a
:class:`~defenses.rps.ensemble.PartVoter`, whose parts may abstain.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.checks import check_int
from defenses.rps.calibration import calibrate_parts
from defenses.rps.certificate import (
    Certificate,
    PartThresholds,
    ProbaGeometry,
    ScoreGeometry,
)
from defenses.rps.ensemble import (
    PartClassifier,
    PartVoter,
    check_estimator,
    predict_parts,
    proba_columns,
    train_parts,
    voter_votes,
)
from defenses.rps.partition import check_features, partition
from defenses.rps.quantile import (
    QUANTILE_MODES,
    QuantileMode,
    check_alpha,
    majority_threshold,
)
from defenses.rps.scores import vote_counts, vote_geometry

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class NotFittedError(RuntimeError):
    """The classifier is used before ``fit`` (or ``calibrate``)."""


class ReliableConformalClassifier:
    """Reliable prediction sets under training and calibration poisoning.

    Parameters
    ----------
    estimator : scikit-learn classifier, TorchPartClassifier or callable
        Base learner, cloned per training part; a callable is a torch model
        factory ``(n_features, n_classes) -> Module``. It must be deterministic
        given its ``random_state`` (seeded per part).
    n_train_parts : int
        ``k_t``, number of hash parts of the training data (1: no training defense).
    n_calib_parts : int
        ``k_c``, number of hash parts of the calibration data (1: no majority).
    alpha : float
        Miscoverage level in (0, 1).
    quantile : {"exact", "official", "markov"}
        Per-part rank rule (see :mod:`defenses.rps.quantile`).
    softmax : bool
        Smooth vote fractions with a softmax (the paper's default) or use them raw.
    random_state : int
        Base seed of the per-part training.
    n_jobs : int or None
        Parallel training jobs (joblib; None: one, -1: all cores).
    """

    def __init__(
        self,
        estimator: Any,
        n_train_parts: int = 10,
        n_calib_parts: int = 10,
        alpha: float = 0.1,
        quantile: QuantileMode = "exact",
        softmax: bool = True,
        random_state: int = 0,
        n_jobs: int | None = None,
    ) -> None:
        check_estimator(estimator)
        self.estimator: Any = estimator
        self._configure(
            n_train_parts, n_calib_parts, alpha, quantile, softmax, random_state, n_jobs
        )

    def _configure(
        self,
        n_train_parts: int,
        n_calib_parts: int,
        alpha: float,
        quantile: QuantileMode,
        softmax: bool,
        random_state: int,
        n_jobs: int | None,
    ) -> None:
        self.n_train_parts = check_int("n_train_parts", n_train_parts, 1)
        self.n_calib_parts = check_int("n_calib_parts", n_calib_parts, 1)
        self.alpha = check_alpha(alpha)
        if quantile not in QUANTILE_MODES:
            raise ValueError(
                f"quantile must be one of {QUANTILE_MODES}, got {quantile!r}"
            )
        self.quantile: QuantileMode = quantile
        if not isinstance(softmax, bool):
            raise ValueError(f"softmax must be a bool, got {softmax!r}")
        self.softmax = softmax
        if (
            isinstance(random_state, bool)
            or not isinstance(random_state, int)
            or random_state < 0
        ):
            raise ValueError(
                f"random_state must be an integer >= 0, got {random_state!r}"
            )
        self.random_state = random_state
        self.n_jobs = n_jobs
        self.tau_hat = majority_threshold(self.n_calib_parts, self.alpha)
        self.models_: list[PartClassifier] | None = None
        self.voter_: PartVoter | None = None
        self.thresholds_: FloatArray | None = None
        self._last_batch: (
            tuple[FloatArray, ScoreGeometry, list[PartClassifier] | None] | None
        ) = None

    @classmethod
    def from_voter(
        cls,
        voter: PartVoter,
        classes: npt.ArrayLike,
        n_features: int,
        n_calib_parts: int = 10,
        alpha: float = 0.1,
        quantile: QuantileMode = "exact",
        softmax: bool = True,
    ) -> ReliableConformalClassifier:
        r"""RPS on part classifiers trained elsewhere; already fitted.

        Parameters
        ----------
        voter : PartVoter
            ``voter.n_parts`` (``k_t``) parts; ``voter.part_votes(X)`` gives, per part
            and point, a class index into ``classes`` or -1 when the part abstains
            (e.g. a shard whose data were all deleted). The training certificate
            assumes each training point can influence at most one part (parts
            formed by a hash of the sample or its id, trained in isolation).
        classes : array-like of shape (K,)
            The class labels, sorted and distinct, K >= 2; index ``c`` of a vote is
            ``classes[c]``, and :meth:`calibrate` takes labels from ``classes``.
        n_features : int
            Number of features of ``X``.
        n_calib_parts, alpha, quantile, softmax
            As in the constructor.

        Returns
        -------
        ReliableConformalClassifier
            Ready for :meth:`calibrate`, then :meth:`predict_sets` and
            :meth:`certify`.

        Notes
        -----
        Votes are **not memoised** for a voter: every :meth:`calibrate`,
        :meth:`predict_sets`, :meth:`predict_scores` and :meth:`certify` call reads
        ``part_votes`` afresh, so a voter whose parts changed (after a deletion) is
        never served stale votes. The thresholds, however, are those of the last
        :meth:`calibrate`: recalibrate after the parts change. :meth:`certify`
        returns the sets too, so calling it alone costs one read of the votes.

        With abstentions the score is :math:`\operatorname{softmax}(v / k_t)` over
        the K classes (an abstaining part votes for none of them), and the
        certificate covers a poisoned part moving between any class and abstain
        (see :mod:`defenses.rps.scores`).
        """
        n_parts = getattr(voter, "n_parts", None)
        if not callable(getattr(voter, "part_votes", None)):
            raise ValueError(f"voter must have a part_votes(X) method, got {voter!r}")
        labels = np.asarray(classes)
        if labels.ndim != 1 or labels.size < 2:
            raise ValueError(
                f"classes must be a 1-d array of at least 2 labels, got shape "
                f"{labels.shape}"
            )
        if np.any(labels[1:] <= labels[:-1]):
            raise ValueError(
                f"classes must be sorted and distinct, got {labels.tolist()}"
            )
        model = cls.__new__(cls)
        model.estimator = None
        model._configure(
            check_int("voter.n_parts", n_parts, 1),
            n_calib_parts,
            alpha,
            quantile,
            softmax,
            0,
            None,
        )
        model.voter_ = voter
        model.classes_ = labels
        model.n_features_in_ = check_int("n_features", n_features, 1)
        return model

    # ------------------------------------------------------------------ fitting
    def fit(self, X: npt.ArrayLike, y: npt.ArrayLike) -> ReliableConformalClassifier:
        """Train one classifier per hash part of (X, y)."""
        if self.voter_ is not None:
            raise ValueError(
                "this classifier was built from a voter (from_voter): its parts are "
                "trained elsewhere, so fit does not apply; call calibrate"
            )
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
        if self.n_train_parts > features.shape[0]:
            raise ValueError(
                f"n_train_parts={self.n_train_parts} exceeds the number of training "
                f"samples ({features.shape[0]})"
            )
        self.n_features_in_ = features.shape[1]
        self.models_, parts = train_parts(
            self.estimator,
            features,
            encoded.astype(np.int64),
            self.n_train_parts,
            self.n_classes,
            self.random_state,
            self.n_jobs,
        )
        self.train_part_sizes_ = np.array([p.size for p in parts], dtype=np.int64)
        self.thresholds_ = None
        self._last_batch = None
        return self

    @property
    def n_classes(self) -> int:
        """Number of classes seen at fit time."""
        return int(self.classes_.size)

    def _check_X(self, X: npt.ArrayLike) -> FloatArray:
        if self.models_ is None and self.voter_ is None:
            raise NotFittedError(
                "ReliableConformalClassifier is not fitted: call fit first"
            )
        features = check_features(X)
        if features.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {features.shape[1]} features, but the classifier was fitted "
                f"with {self.n_features_in_}"
            )
        return features

    def _encode(self, y: npt.ArrayLike, n: int) -> IntArray:
        labels = np.asarray(y)
        if labels.shape != (n,):
            raise ValueError(f"y must have shape ({n},), got {labels.shape}")
        unseen = np.setdiff1d(labels, self.classes_)
        if unseen.size:
            raise ValueError(
                f"labels {unseen.tolist()} were not seen at fit time "
                f"(classes: {self.classes_.tolist()})"
            )
        return np.searchsorted(self.classes_, labels).astype(np.int64)

    def predict_votes(self, X: npt.ArrayLike) -> IntArray:
        """Votes of the part classifiers, shape (n, K) (the models' work).

        With a voter, rows sum to ``n_train_parts`` minus the abstentions.
        """
        features = self._check_X(X)
        if self.voter_ is not None:
            return self._voter_votes(features)
        assert self.models_ is not None
        return vote_counts(predict_parts(self.models_, features), self.n_classes)

    def _voter_votes(self, features: FloatArray) -> IntArray:
        assert self.voter_ is not None
        return voter_votes(self.voter_, features, self.n_train_parts, self.n_classes)

    def _geometry(self, features: FloatArray) -> ScoreGeometry:
        """The models' scores of ``features``; the last batch is memoised.

        ``predict_sets`` followed by ``certify`` on the same points (or repeated
        calls) run the part models once: the batch is kept with its scores and
        compared exactly (and the models by identity) before reuse. A voter's
        votes are never memoised (its parts may change between calls).
        """
        if self.voter_ is not None:
            return vote_geometry(
                self._voter_votes(features), self.n_train_parts, self.softmax, True
            )
        cached = self._last_batch
        if (
            cached is not None
            and cached[2] is self.models_
            and cached[0].shape == features.shape
            and np.array_equal(cached[0], features)
        ):
            return cached[1]
        geometry = self._compute_geometry(features)
        self._last_batch = (features.copy(), geometry, self.models_)
        return geometry

    def _compute_geometry(self, features: FloatArray) -> ScoreGeometry:
        assert self.models_ is not None
        if self.n_train_parts == 1:
            return ProbaGeometry(
                proba_columns(self.models_[0], features, self.n_classes)
            )
        votes = vote_counts(predict_parts(self.models_, features), self.n_classes)
        return vote_geometry(votes, self.n_train_parts, self.softmax)

    def predict_scores(self, X: npt.ArrayLike) -> FloatArray:
        """Conformity scores s(x, y), shape (n, K)."""
        geometry = self._geometry(self._check_X(X))
        return geometry.score()[geometry.index]

    @property
    def _max_radius(self) -> int:
        if self.n_train_parts == 1 and self.voter_ is None:
            return 0
        return self.n_train_parts

    def _radius(self, max_train_radius: int | None) -> int:
        radius = self._max_radius if max_train_radius is None else max_train_radius
        return min(check_int("max_train_radius", radius, 0), self._max_radius)

    # -------------------------------------------------------------- calibrating
    def calibrate(
        self, X: npt.ArrayLike, y: npt.ArrayLike, max_train_radius: int | None = None
    ) -> ReliableConformalClassifier:
        """Compute each calibration part's threshold and its worst-case range.

        ``max_train_radius`` caps the training radius the thresholds' worst case is
        computed for (default ``n_train_parts``; 0 skips it, leaving only
        calibration-side certificates).
        """
        features = self._check_X(X)
        labels = self._encode(y, features.shape[0])
        return self.calibrate_geometry(
            features, labels, self._geometry(features), max_train_radius
        )

    def geometry(self, X: npt.ArrayLike) -> ScoreGeometry:
        """Scores and bound machinery of ``X`` (the models' predictions, reusable)."""
        return self._geometry(self._check_X(X))

    def calibrate_geometry(
        self,
        features: FloatArray,
        labels: IntArray,
        geometry: ScoreGeometry,
        max_train_radius: int | None = None,
    ) -> ReliableConformalClassifier:
        """:meth:`calibrate` from precomputed scores (``labels`` encoded 0..K-1).

        Lets studies recalibrate on many splits without re-running the models.
        """
        k_c = self.n_calib_parts
        if k_c > features.shape[0]:
            raise ValueError(
                f"n_calib_parts={k_c} exceeds the number of calibration samples "
                f"({features.shape[0]})"
            )
        parts = partition(features, labels, k_c)
        entries = geometry.index[np.arange(features.shape[0]), labels]
        calibration = calibrate_parts(
            parts,
            entries,
            geometry,
            self.alpha,
            self.quantile,
            self._radius(max_train_radius),
        )
        sizes = calibration.sizes
        self.calib_part_sizes_ = sizes
        self.ranks_ = calibration.ranks
        self.guard_ = calibration.guard
        self.part_thresholds_ = calibration.part_thresholds
        self.thresholds_ = calibration.thresholds
        self.miscoverage_bound_ = calibration.miscoverage_bound
        logger.info(
            "calibrated %d parts (sizes %d..%d), tau_hat=%d, exact miscoverage %.4f",
            k_c,
            sizes.min(),
            sizes.max(),
            self.tau_hat,
            self.miscoverage_bound_,
        )
        return self

    def _check_calibrated(self) -> PartThresholds:
        if self.models_ is None and self.voter_ is None:
            raise NotFittedError(
                "ReliableConformalClassifier is not fitted: call fit first"
            )
        if self.thresholds_ is None:
            raise NotFittedError(
                "ReliableConformalClassifier is not calibrated: call calibrate first"
            )
        return self.part_thresholds_

    # --------------------------------------------------------------- predicting
    def predict_sets(self, X: npt.ArrayLike) -> BoolArray:
        """Majority prediction sets, boolean (n, K) with columns ``classes_``.

        A class is in more than ``tau_hat`` part sets exactly when its score
        reaches the ``(tau_hat + 1)``-th smallest part threshold.
        """
        thresholds = self._check_calibrated()
        return np.asarray(self.predict_scores(X) >= thresholds.cut)

    def certify(
        self, X: npt.ArrayLike, max_train_radius: int | None = None
    ) -> Certificate:
        """Certified radii per point and class (the sets are included).

        Parameters
        ----------
        X : array of shape (n, d)
            Test points.
        max_train_radius : int or None
            Largest training radius examined (default and at most
            ``n_train_parts``; radii are capped there, which is sound).

        Returns
        -------
        Certificate
            The sets (``Certificate.sets`` equals :meth:`predict_sets`, so calling
            both is not needed) and the radii.
        """
        thresholds = self._check_calibrated()
        features = self._check_X(X)
        radius = min(self._radius(max_train_radius), thresholds.radius)
        thresholds = thresholds.truncated(radius)
        geometry = self._geometry(features)
        in_set = np.asarray(geometry.score() >= thresholds.cut)
        index = geometry.index
        training = geometry.largest(thresholds, in_set, joint=False)
        calibration = thresholds.calibration_radius(geometry, in_set, 0)
        ceiling = np.minimum(training, calibration)
        joint = geometry.largest(thresholds, in_set, joint=True, ceiling=ceiling)
        return Certificate(
            sets=in_set[index],
            training=training[index],
            calibration=calibration[index],
            joint=joint[index],
            max_train_radius=radius,
            geometry=geometry,
            thresholds=thresholds,
            in_set=in_set,
        )
