import numpy as np
import pytest
from mapie.classification import SplitConformalClassifier as MapieSplit
from sklearn.linear_model import LogisticRegression

from defenses.metrics import coverage
from defenses.rps.baselines import EnsembleConformalClassifier, SplitConformalClassifier
from defenses.rps.defense import NotFittedError


def test_split_conformal_matches_mapie(digits_split):
    (Xt, yt), (Xc, yc), (Xs, ys) = digits_split
    ours = SplitConformalClassifier(LogisticRegression(max_iter=1000), 0.9).fit(Xt, yt)
    ours.conformalize(Xc, yc)
    mapie = MapieSplit(
        estimator=ours.model_, confidence_level=0.9, conformity_score="lac", prefit=True
    ).conformalize(Xc, yc)
    _, theirs = mapie.predict_set(Xs)
    _, sets = ours.predict_set(Xs)
    assert sets.shape == theirs.shape == (len(ys), 10, 1)
    assert np.array_equal(sets, theirs)
    assert coverage(sets[:, :, 0], ys) >= 0.85


def test_bagging_ensemble(digits_split):
    (Xt, yt), (Xc, yc), (Xs, ys) = digits_split
    a = EnsembleConformalClassifier(LogisticRegression(max_iter=1000), 4, 0.9)
    b = EnsembleConformalClassifier(LogisticRegression(max_iter=1000), 4, 0.9)
    a.fit(Xt, yt).conformalize(Xc, yc)
    b.fit(Xt, yt).conformalize(Xc, yc)
    assert np.array_equal(a.predict_set(Xs)[1], b.predict_set(Xs)[1])
    assert coverage(a.predict_set(Xs)[1][:, :, 0], ys) >= 0.85


def test_baseline_bad_input(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    with pytest.raises(NotFittedError, match="not fitted"):
        SplitConformalClassifier(LogisticRegression(), 0.9).predict_set(Xs)
    fitted = SplitConformalClassifier(LogisticRegression(max_iter=1000), 0.9).fit(
        Xt, yt
    )
    with pytest.raises(NotFittedError, match="not conformalized"):
        fitted.predict_set(Xs)
    with pytest.raises(ValueError, match="too few"):
        fitted.conformalize(Xc[:5], yc[:5])
    with pytest.raises(ValueError, match="not seen"):
        fitted.conformalize(Xc, yc + 20)
    with pytest.raises(ValueError, match="confidence_level"):
        SplitConformalClassifier(LogisticRegression(), 1.5)
    with pytest.raises(ValueError, match="n_models"):
        EnsembleConformalClassifier(LogisticRegression(), 0)
