"""MAPIE 1.x's confidence_level lists, prefit=True and conformity_score, with MAPIE."""

import numpy as np
import pytest
from mapie.classification import SplitConformalClassifier as MapieSplit
from mapie.conformity_scores import APSConformityScore, LACConformityScore
from sklearn.base import clone
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
