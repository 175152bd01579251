"""MAPIE 1.x's confidence_level lists, prefit=True and conformity_score, with MAPIE."""

import numpy as np
import pytest
from mapie.classification import SplitConformalClassifier as MapieSplit
from mapie.conformity_scores import APSConformityScore, LACConformityScore
from sklearn.base import BaseEstimator, ClassifierMixin, clone
from sklearn.exceptions import NotFittedError
from sklearn.frozen import FrozenEstimator
from sklearn.linear_model import LogisticRegression

from defenses.rps import ReliableConformalClassifier
from defenses.rps.conformity import PREFIT_FIT_MESSAGE

LEVELS = [0.8, 0.9]


def lr():
    return LogisticRegression(max_iter=1000)


def test_confidence_level_lists_match_mapie_and_one_level_at_a_time(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    fitted = lr().fit(Xt, yt)
    mapie = MapieSplit(fitted, confidence_level=LEVELS, prefit=True)
    theirs = mapie.conformalize(Xc, yc).predict_set(Xs)[1]
    ours = ReliableConformalClassifier(
        fitted, n_train_parts=1, n_calib_parts=1, confidence_level=LEVELS, prefit=True
    )
    sets = ours.conformalize(Xc, yc).predict_set(Xs)[1]
    assert sets.shape == theirs.shape == (len(Xs), 10, 2)
    assert np.array_equal(sets, theirs)
    assert (sets[:, :, 0] <= sets[:, :, 1]).all()  # 0.9-sets hold the 0.8-sets
    assert ours.tau_hat_.shape == (2,)
    # with the defense on, each level is the RPS of that level alone
    both = ReliableConformalClassifier(
        lr(), n_train_parts=5, n_calib_parts=3, confidence_level=LEVELS
    ).fit(Xt, yt)
    stacked = both.conformalize(Xc, yc).predict_set(Xs)[1]
    assert both.thresholds_.shape == (2, 3)
    for i, level in enumerate(LEVELS):
        alone = ReliableConformalClassifier(
            lr(), n_train_parts=5, n_calib_parts=3, confidence_level=level
        ).fit(Xt, yt)
        assert np.array_equal(
            stacked[:, :, i], alone.conformalize(Xc, yc).predict_set(Xs)[1][:, :, 0]
        )
        cert = both.certify(Xs, confidence_level=level)
        assert np.array_equal(cert.sets, stacked[:, :, i])
        assert np.array_equal(cert.training, alone.certify(Xs).training)
    with pytest.raises(ValueError, match="name the one to certify"):
        both.certify(Xs)
    with pytest.raises(ValueError, match="was not conformalized"):
        both.certify(Xs, confidence_level=0.95)


@pytest.mark.parametrize(
    ("level", "match"),
    [
        ([], "non-empty list"),
        ([0.8, 1.2], r"confidence_level\[1\]"),
        ([0.8, float("nan")], r"confidence_level\[1\]"),
        ("0.9", "confidence_level"),
        (0.0, "confidence_level"),
    ],
)
def test_bad_confidence_levels_are_refused_naming_the_entry(digits_split, level, match):
    (Xt, yt), _, _ = digits_split
    with pytest.raises((ValueError, TypeError), match=match):
        ReliableConformalClassifier(lr(), n_train_parts=2, confidence_level=level).fit(
            Xt, yt
        )


def test_prefit_conformalizes_a_fitted_model_with_any_labels(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    words = np.array([f"d{c}" for c in range(10)], dtype=object)
    fitted = lr().fit(Xt, words[yt])
    ours = ReliableConformalClassifier(
        fitted, n_train_parts=1, n_calib_parts=1, prefit=True
    ).conformalize(Xc, words[yc])
    mapie = MapieSplit(fitted, prefit=True).conformalize(Xc, words[yc])
    assert np.array_equal(ours.predict_set(Xs)[1], mapie.predict_set(Xs)[1])
    assert np.array_equal(ours.predict(Xs), fitted.predict(Xs))
    assert ours.estimators_[0] is fitted  # used as it is, never refitted
    with pytest.raises(ValueError, match="The fit method must be skipped") as error:
        ours.fit(Xt, words[yt])
    assert str(error.value) == PREFIT_FIT_MESSAGE
    # the calibration-side defense still applies to a prefit model
    majority = ReliableConformalClassifier(
        fitted, n_train_parts=1, n_calib_parts=5, prefit=True
    ).conformalize(Xc, words[yc])
    cert = majority.certify(Xs)
    assert cert.robust(0, 1).mean() > 0.5
    assert not cert.robust(1, 0).any()  # one model: no training certificate


def test_prefit_refusals_and_clone(digits_split):
    (Xt, yt), (Xc, yc), _ = digits_split
    fitted = lr().fit(Xt, yt)
    with pytest.raises(ValueError, match="n_train_parts must be 1, got 10"):
        ReliableConformalClassifier(fitted, prefit=True).conformalize(Xc, yc)
    unfitted = ReliableConformalClassifier(lr(), n_train_parts=1, prefit=True)
    with pytest.raises(NotFittedError, match="FrozenEstimator"):
        unfitted.conformalize(Xc, yc)
    cloned = clone(
        ReliableConformalClassifier(
            FrozenEstimator(fitted), n_train_parts=1, n_calib_parts=2, prefit=True
        )
    )
    assert cloned.conformalize(Xc, yc).predict_set(Xc)[1].shape == (len(Xc), 10, 1)
    with pytest.raises(TypeError, match="prefit must be a bool"):
        ReliableConformalClassifier(fitted, n_train_parts=1, prefit="yes").conformalize(
            Xc, yc
        )


def test_conformity_score_lac_carries_over_and_the_rest_is_refused(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    by_name = ReliableConformalClassifier(lr(), n_train_parts=3, n_calib_parts=2)
    by_object = ReliableConformalClassifier(
        lr(), n_train_parts=3, n_calib_parts=2, conformity_score=LACConformityScore()
    )
    a = by_name.fit(Xt, yt).conformalize(Xc, yc).predict_set(Xs)[1]
    b = by_object.fit(Xt, yt).conformalize(Xc, yc).predict_set(Xs)[1]
    assert np.array_equal(a, b)
    for score in ("aps", "raps", "top_k", APSConformityScore()):
        with pytest.raises(ValueError, match="not supported by RPS"):
            ReliableConformalClassifier(
                lr(), n_train_parts=2, conformity_score=score
            ).fit(Xt, yt)
    with pytest.raises(ValueError, match="Invalid conformity_score parameter"):
        ReliableConformalClassifier(lr(), n_train_parts=2, conformity_score="x").fit(
            Xt, yt
        )


class TableModel(ClassifierMixin, BaseEstimator):
    """A fitted 'classifier' whose probabilities are the columns of X."""

    def __init__(self, n_classes=3):
        self.n_classes = n_classes
        self.classes_ = np.arange(n_classes)
        self.n_features_in_ = n_classes

    def fit(self, X, y):
        return self

    def predict_proba(self, X):
        return np.asarray(X, dtype=np.float64)

    def predict(self, X):
        return np.asarray(X).argmax(axis=1)

    def __sklearn_is_fitted__(self):
        return True


def probability_rows(n, rng):
    return rng.dirichlet(np.ones(3), size=n)


def both_sets(level, X_cal, y_cal, X_test):
    model = TableModel(3)
    mapie = MapieSplit(model, confidence_level=level, prefit=True)
    theirs = mapie.conformalize(X_cal, y_cal).predict_set(X_test)[1][:, :, 0]
    ours = ReliableConformalClassifier(
        model, n_train_parts=1, n_calib_parts=1, confidence_level=level, prefit=True
    )
    mine = ours.conformalize(X_cal, y_cal).predict_set(X_test)[1][:, :, 0]
    return mine, theirs, float(ours.thresholds_[0])


@pytest.mark.parametrize(("level", "n"), [(0.9, 99), (0.8, 149), (0.55, 79)])
def test_sets_equal_mapies_away_from_its_tolerance_and_float_rank(level, n):
    """docs/rps.md: equal when (n + 1) * level rounds to its exact value and no
    test score lies within MAPIE's 1e-8 below the threshold."""
    rng = np.random.default_rng(n)
    X_cal = probability_rows(n, rng)
    y_cal = rng.integers(0, 3, n)
    X_test = probability_rows(400, rng)
    mine, theirs, tau = both_sets(level, X_cal, y_cal, X_test)
    assert not np.any((X_test < tau) & (X_test >= tau - 1e-7))
    assert np.array_equal(mine, theirs)


def test_mapie_tolerance_includes_a_class_rps_leaves_out():
    """MAPIE keeps {y : (1 - p_y) - q <= 1e-8}: a class 5e-9 below the threshold
    is in MAPIE's set, not in RPS's (which compares exactly)."""
    rng = np.random.default_rng(0)
    X_cal, y_cal = probability_rows(99, rng), rng.integers(0, 3, 99)
    _, _, tau = both_sets(0.9, X_cal, y_cal, X_cal[:1])
    near = np.array([[tau - 5e-9, 1.0 - (tau - 5e-9) - 0.25, 0.25]])
    mine, theirs, _ = both_sets(0.9, X_cal, y_cal, near)
    assert theirs[0, 0]
    assert not mine[0, 0]
    assert (mine <= theirs).all()


def test_mapie_float_rank_steps_where_the_level_times_n_plus_one_is_whole():
    """At confidence 0.55 and n = 99, (n + 1) * 0.55 = 55 exactly, but the float
    product is 55.00000000000001: MAPIE's ceil gives 56, a threshold one rank
    lower and larger sets; RPS's rank is the exact floor((n + 1) * 0.45) = 45."""
    assert 100 * 0.55 > 55
    rng = np.random.default_rng(3)
    X_cal, y_cal = probability_rows(99, rng), rng.integers(0, 3, 99)
    X_test = probability_rows(2000, rng)
    mine, theirs, tau = both_sets(0.55, X_cal, y_cal, X_test)
    scores = np.sort(X_cal[np.arange(99), y_cal])
    assert tau == scores[45 - 1]
    assert (mine <= theirs).all()
    assert (theirs & ~mine).any()  # the classes between the 44th and 45th score
    assert np.all(X_test[theirs & ~mine] >= scores[44 - 1])
