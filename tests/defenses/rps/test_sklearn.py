"""RPS in scikit-learn's and MAPIE's ecosystems, tested with their own objects."""

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from mapie.classification import SplitConformalClassifier as MapieSplit
from scipy import sparse
from sklearn.base import clone
from sklearn.compose import ColumnTransformer
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.exceptions import NotFittedError
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler
from sklearn.utils import get_tags
from sklearn.utils.estimator_checks import check_estimator
from sklearn.utils.validation import check_is_fitted

from defenses.rps import (
    DegeneratePartsWarning,
    ReliableConformalClassifier,
    TorchPartClassifier,
)
from defenses.rps.sklearn import coverage_size_scorer

NOT_APPLICABLE = {
    # RPS computes in numpy; array-API inputs (torch / cupy arrays through
    # SCIPY_ARRAY_API=1) are not supported. scikit-learn skips the check unless
    # that variable is set.
    "check_array_api_input": "numpy only: array API inputs are not supported",
}
"""Checks of ``check_estimator`` that cannot apply to RPS, and why.

Every other check runs and passes. ``check_estimator`` knows ``fit`` / ``predict``
only: the set-valued part (``conformalize``, ``predict_set``, ``certify``) is tested
below and in ``test_defense.py``."""


def lr(**params):
    return LogisticRegression(max_iter=1000, **params)


def test_check_estimator_passes_every_applicable_check():
    estimator = ReliableConformalClassifier(lr(), n_train_parts=3, n_calib_parts=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = check_estimator(estimator, on_fail=None, on_skip=None)
    failed = {
        r["check_name"]: r["exception"] for r in results if r["status"] == "failed"
    }
    skipped = {r["check_name"] for r in results if r["status"] == "skipped"}
    assert failed == {}
    assert skipped <= set(NOT_APPLICABLE)
    assert len(results) > 40


def test_clone_params_and_fitted_state(digits_split):
    (Xt, yt), (Xc, yc), (Xs, ys) = digits_split
    rps = ReliableConformalClassifier(lr(C=0.5), n_train_parts=4, n_calib_parts=4)
    twin = clone(rps)
    assert twin.get_params(deep=False).keys() == rps.get_params(deep=False).keys()
    assert twin.get_params(deep=True)["estimator__C"] == 0.5
    with pytest.raises(NotFittedError):
        check_is_fitted(rps)
    rps.fit(Xt, yt)
    check_is_fitted(rps)
    rps.set_params(n_calib_parts=2, confidence_level=0.8)  # the IndexError
    _, sets = rps.conformalize(Xc, yc).predict_set(Xs)
    assert rps.tau_hat_ == 0
    assert rps.calib_part_sizes_.size == 2
    assert sets.shape == (len(ys), 10, 1)
    rps.set_params(n_train_parts=6)
    with pytest.raises(ValueError, match="n_train_parts"):
        rps.conformalize(Xc, yc)
    rps.set_params(estimator__C=2.0).fit(Xt, yt).conformalize(Xc, yc)
    assert len(rps.estimators_) == 6
    assert all(m.C == 2.0 for m in rps.estimators_)
    assert not hasattr(clone(rps), "estimators_")
    assert get_tags(rps).input_tags.sparse
    assert not get_tags(rps).input_tags.allow_nan
    nan_ok = ReliableConformalClassifier(HistGradientBoostingClassifier())
    assert get_tags(nan_ok).input_tags.allow_nan


def test_grid_search_over_the_wrapped_estimator(digits_split):
    (Xt, yt), _, _ = digits_split
    search = GridSearchCV(
        ReliableConformalClassifier(lr(), n_train_parts=3, n_calib_parts=1),
        {"estimator__C": [1e-4, 1.0]},
        scoring=coverage_size_scorer(),
        cv=2,
    )
    with pytest.warns(DegeneratePartsWarning, match="too constrained"):
        search.fit(Xt, yt)  # C = 1e-4: constant parts, and RPS says so
    scores = search.cv_results_["mean_test_score"]
    assert np.all(np.isfinite(scores))
    # A near-constant model (C = 1e-4) needs large sets to cover: it loses.
    assert search.best_params_ == {"estimator__C": 1.0}
    assert scores[1] > scores[0]


def test_mapie_and_rps_give_identical_sets_for_plain_split_conformal(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    rps = ReliableConformalClassifier(lr(), n_train_parts=1, n_calib_parts=1)
    rps.fit(Xt, yt).conformalize(Xc, yc)
    mapie = MapieSplit(
        estimator=rps.estimators_[0],
        confidence_level=0.9,
        conformity_score="lac",
        prefit=True,
    ).conformalize(Xc, yc)
    theirs_pred, theirs = mapie.predict_set(Xs)
    ours_pred, ours = rps.predict_set(Xs)
    assert ours.shape == theirs.shape == (len(Xs), 10, 1)
    assert np.array_equal(ours, theirs)
    assert np.array_equal(ours_pred, theirs_pred)
    assert 0 < ours.sum(axis=1).mean() < 10


def _frame(n=600, seed=0):
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(
        {
            "city": rng.choice(["lyon", "oslo", "rome"], n),
            "age": rng.normal(40, 10, n),
        }
    )
    score = (frame.city == "oslo") * 2.0 + (frame.age - 40) / 5
    return frame, np.where(score + rng.normal(0, 0.3, n) > 0.7, "yes", "no")


def test_pipeline_on_a_dataframe_with_a_string_column():
    frame, y = _frame()
    prep = ColumnTransformer(
        [("city", OneHotEncoder(), ["city"]), ("age", StandardScaler(), ["age"])]
    )
    rps = ReliableConformalClassifier(
        make_pipeline(prep, lr()), n_train_parts=5, n_calib_parts=2
    )
    rps.fit(frame[:300], y[:300]).conformalize(frame[300:450], y[300:450])
    y_pred, sets = rps.predict_set(frame[450:])
    assert rps.classes_.tolist() == ["no", "yes"]
    assert set(y_pred) <= {"no", "yes"}
    assert np.mean(y_pred == y[450:]) > 0.8
    covered = (sets[:, :, 0] & (rps.classes_ == y[450:, None])).any(axis=1)
    assert covered.mean() > 0.8
    assert rps.feature_names_in_.tolist() == ["city", "age"]
    shuffled = frame[450:].sample(frac=1.0, random_state=0)
    again = rps.predict_set(shuffled)[1]
    assert np.array_equal(again, sets[frame.index[450:].get_indexer(shuffled.index)])


def test_sparse_input_reaches_the_parts_as_sparse(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    rps = ReliableConformalClassifier(lr(), n_train_parts=4, n_calib_parts=2)
    rps.fit(sparse.csr_matrix(Xt), yt).conformalize(sparse.csr_matrix(Xc), yc)
    a = rps.predict_set(sparse.csr_matrix(Xs))[1]
    b = rps.predict_set(sparse.coo_matrix(Xs))[1]
    assert np.array_equal(a, b)
    coo = ReliableConformalClassifier(lr(), n_train_parts=4, n_calib_parts=2)
    coo.fit(sparse.coo_matrix(Xt), yt).conformalize(sparse.csc_matrix(Xc), yc)
    assert np.array_equal(coo.predict_set(Xs)[1], a)


def test_nan_features_go_to_estimators_that_accept_them(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    holes = np.random.default_rng(0)

    def punch(X):
        X = X.copy()
        X[holes.random(X.shape) < 0.05] = np.nan
        return X

    rps = ReliableConformalClassifier(
        HistGradientBoostingClassifier(max_iter=20), n_train_parts=2, n_calib_parts=2
    )
    rps.fit(punch(Xt), yt).conformalize(punch(Xc), yc)
    sets = rps.predict_set(punch(Xs))[1]
    assert sets.shape == (len(Xs), 10, 1)
    with pytest.raises(ValueError, match="Input X contains NaN"):
        ReliableConformalClassifier(lr(), n_train_parts=2).fit(punch(Xt), yt)


@pytest.mark.parametrize("missing", [np.nan, None, pd.NA])
def test_missing_labels_are_refused(digits_split, missing):
    (Xt, yt), _, _ = digits_split
    labels = yt.astype(object) if missing is not np.nan else yt.astype(float)
    labels[3] = missing
    with pytest.raises(ValueError, match=r"y contains NaN: 1 missing label"):
        ReliableConformalClassifier(lr(), n_train_parts=2).fit(Xt, labels)


def test_labels_of_any_type(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    words = np.array([f"d{c}" for c in range(10)], dtype=object)
    a = ReliableConformalClassifier(lr(), n_train_parts=3, n_calib_parts=2)
    a.fit(Xt, words[yt]).conformalize(Xc, words[yc])
    b = ReliableConformalClassifier(lr(), n_train_parts=3, n_calib_parts=2)
    b.fit(Xt, yt).conformalize(Xc, yc)
    assert np.array_equal(a.predict_set(Xs)[1], b.predict_set(Xs)[1])
    assert set(a.predict(Xs)) <= set(words)
    mixed = yt.astype(object)
    mixed[0] = "zero"
    with pytest.raises(TypeError, match="y mixes label types"):
        ReliableConformalClassifier(lr(), n_train_parts=2).fit(Xt, mixed)


def test_torch_factory_initialisation_is_used_as_is(digits_split):
    (Xt, yt), _, _ = digits_split

    def factory(d, k):
        return torch.nn.Sequential(
            torch.nn.Linear(d, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, k)
        )

    state = torch.random.get_rng_state()
    part = TorchPartClassifier(factory, epochs=1, lr=1e-12, seed=3).fit(Xt, yt, 10)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    gamma = part.model_[1].weight.detach()
    assert torch.allclose(gamma, torch.ones(8))  # BatchNorm's own init (1), kept
    with torch.random.fork_rng():
        torch.manual_seed(3)
        reference = factory(64, 10)
    assert torch.allclose(part.model_[0].weight, reference[0].weight, atol=1e-9)
    again = TorchPartClassifier(factory, epochs=1, lr=1e-12, seed=3).fit(Xt, yt, 10)
    assert torch.equal(again.model_[0].weight, part.model_[0].weight)


def test_degenerate_parts_warn_with_the_likely_cause():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 4))
    y = (X[:, 0] + 0.3 * rng.normal(size=600) > 0).astype(int)
    small = ReliableConformalClassifier(
        HistGradientBoostingClassifier(max_iter=10),
        n_train_parts=10,
        n_calib_parts=1,
    ).fit(X[:280], y[:280])
    with pytest.warns(DegeneratePartsWarning, match="too many training parts"):
        small.conformalize(X[280:], y[280:])
    healthy = ReliableConformalClassifier(lr(), n_train_parts=4, n_calib_parts=1)
    healthy.fit(X[:280], y[:280])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DegeneratePartsWarning)
        healthy.conformalize(X[280:], y[280:])
