import numpy as np
import pytest
from mapie.classification import SplitConformalClassifier as MapieSplit
from sklearn.linear_model import LogisticRegression

from defenses.metrics import coverage
from defenses.rps.baselines import EnsembleConformalClassifier, SplitConformalClassifier
from defenses.rps.defense import NotFittedError


def test_split_conformal_matches_mapie(digits_split):
    (Xt, yt), (Xc, yc), (Xs, ys) = digits_split
    ours = SplitConformalClassifier(LogisticRegression(max_iter=1000), 0.1).fit(Xt, yt)
    ours.calibrate(Xc, yc)
    mapie = MapieSplit(
        estimator=ours.model_, confidence_level=0.9, conformity_score="lac", prefit=True
    ).conformalize(Xc, yc)
    _, theirs = mapie.predict_set(Xs)
    assert np.array_equal(ours.predict_sets(Xs), theirs[:, :, 0])
    assert coverage(ours.predict_sets(Xs), ys) >= 0.85


def test_bagging_ensemble(digits_split):
    (Xt, yt), (Xc, yc), (Xs, ys) = digits_split
    a = EnsembleConformalClassifier(LogisticRegression(max_iter=1000), 4, 0.1).fit(
        Xt, yt
    )
    b = EnsembleConformalClassifier(LogisticRegression(max_iter=1000), 4, 0.1).fit(
        Xt, yt
    )
    a.calibrate(Xc, yc)
    b.calibrate(Xc, yc)
    assert np.array_equal(a.predict_sets(Xs), b.predict_sets(Xs))
    assert coverage(a.predict_sets(Xs), ys) >= 0.85


def test_baseline_bad_input(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    with pytest.raises(NotFittedError, match="not fitted"):
        SplitConformalClassifier(LogisticRegression(), 0.1).predict_sets(Xs)
    fitted = SplitConformalClassifier(LogisticRegression(max_iter=1000), 0.1).fit(
        Xt, yt
    )
    with pytest.raises(NotFittedError, match="not calibrated"):
        fitted.predict_sets(Xs)
    with pytest.raises(ValueError, match="too few"):
        fitted.calibrate(Xc[:5], yc[:5])
    with pytest.raises(ValueError, match="not seen"):
        fitted.calibrate(Xc, yc + 20)
    with pytest.raises(ValueError, match="alpha"):
        SplitConformalClassifier(LogisticRegression(), 1.5)
    with pytest.raises(ValueError, match="n_models"):
        EnsembleConformalClassifier(LogisticRegression(), 0)
