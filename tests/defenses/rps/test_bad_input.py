"""The bad-input rule on every public entry point of RPS (issue 19).

Each call either returns a valid result (finite; sets boolean of shape (n, K, 1);
labels from ``classes_``) or raises ValueError/TypeError naming the parameter
(:func:`defenses.testing.assert_rule`). Few examples by default, ten times more
with ``--runslow``.
"""

import warnings

import numpy as np
import pytest
from hypothesis import given
from sklearn.linear_model import LogisticRegression

from defenses.rps import ReliableConformalClassifier, TorchPartClassifier
from defenses.rps.arms import RPS, BaggingEnsemble, SplitConformalLearner
from defenses.rps.attacks import ATTACKS
from defenses.rps.baselines import SplitConformalClassifier
from defenses.rps.benchmark import coverage_study, performance, tradeoff
from defenses.rps.partition import part_of
from defenses.rps.scenario import ConformalPoisoning
from defenses.rps.sklearn import coverage_size_scorer
from defenses.testing import assert_rule, bad_arrays, bad_reals, rule_settings

N, D, K = 60, 4, 3
RNG = np.random.default_rng(0)
X0 = RNG.normal(size=(N, D))
Y0 = (X0[:, 0] > 0).astype(int) + (X0[:, 1] > 0.5)


def model(**params):
    base = {"n_train_parts": 2, "n_calib_parts": 1, "confidence_level": 0.8}
    return ReliableConformalClassifier(LogisticRegression(), **{**base, **params})


FITTED = model().fit(X0[:30], Y0[:30]).conformalize(X0[30:], Y0[30:])
CERT = FITTED.certify(X0[:8])


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def labels_for(X):
    n = X.shape[0] if X.ndim else 0
    return np.arange(n) % K


def valid_sets(n):
    def check(result):
        y_pred, sets = result
        assert sets.dtype == bool
        assert sets.shape == (n, K, 1)
        assert set(np.asarray(y_pred).tolist()) <= set(FITTED.classes_.tolist())

    return check


@rule_settings()
@given(X=bad_arrays((8, D)))
def test_predict_set_and_certify(X):
    n = X.shape[0] if X.ndim else 0
    assert_rule(lambda: FITTED.predict_set(X), ["X"], valid_sets(n))
    assert_rule(lambda: FITTED.certify(X), ["X"])
    assert_rule(lambda: FITTED.predict(X), ["X"])


@rule_settings(10)
@given(X=bad_arrays((N, D)))
def test_fit_and_conformalize(X):
    params = ["X", "y", "n_train_parts", "n_calib_parts", "class"]
    assert_rule(lambda: model().fit(X, labels_for(X)), params)
    assert_rule(lambda: FITTED.conformalize(X, labels_for(X)), params)
    FITTED.conformalize(X0[30:], Y0[30:])


@rule_settings()
@given(value=bad_reals())
def test_parameters(value):
    for name in ("confidence_level", "n_train_parts", "n_calib_parts", "random_state"):
        assert_rule(lambda name=name: model(**{name: value}).fit(X0, Y0), [name])
    assert_rule(lambda: model(softmax=value).fit(X0, Y0), ["softmax"])
    assert_rule(lambda: model(quantile=value).fit(X0, Y0), ["quantile"])


@rule_settings()
@given(value=bad_reals())
def test_radii(value):
    def robust(result):
        assert result.shape == (8,)
        assert result.dtype == bool

    assert_rule(lambda: CERT.robust(value, 0), ["train_radius"], robust)
    assert_rule(lambda: CERT.robust(0, value), ["calib_radius"], robust)
    assert_rule(lambda: CERT.calibration_radius(value), ["train_radius"])
    assert_rule(lambda: FITTED.certify(X0[:4], value), ["max_train_radius"])


@rule_settings()
@given(value=bad_reals(), X=bad_arrays((8, D)))
def test_partition_and_baseline(value, X):
    assert_rule(lambda: part_of(X0, value), ["n_parts"])
    assert_rule(lambda: part_of(X, 3), ["X"])
    assert_rule(
        lambda: SplitConformalClassifier(LogisticRegression(), value), ["confidence"]
    )
    assert_rule(lambda: coverage_size_scorer(value), ["conformalize_fraction"])
    assert_rule(lambda: coverage_size_scorer(0.5, value), ["tolerance"])


def factory(d, k):
    import torch

    return torch.nn.Linear(d, k)


@rule_settings(6)
@given(value=bad_reals().filter(lambda v: not isinstance(v, int) or abs(v) < 20))
def test_torch_part(value):
    """Huge epoch counts are valid but slow: the strategy keeps integers small."""
    assert_rule(
        lambda: TorchPartClassifier(factory, epochs=value).fit(X0, Y0, K), ["epochs"]
    )
    assert_rule(
        lambda: TorchPartClassifier(factory, epochs=2, lr=value).fit(X0, Y0, K), ["lr"]
    )


def test_regressions_of_issue_19():
    labels = Y0.astype(float)
    labels[[1, 5]] = np.nan
    with pytest.raises(ValueError, match="y contains NaN: 2 missing label"):
        model().fit(X0, labels)
    with pytest.raises(ValueError, match="y contains NaN"):
        FITTED.conformalize(X0[30:], labels[30:].copy() * np.nan)
    with pytest.raises(ValueError, match="train_radius"):
        CERT.robust(2.9999, 0)
    with pytest.raises(ValueError, match="n_jobs"):
        model(n_jobs=0).fit(X0, Y0)
    a = model(random_state=np.int64(1)).fit(X0, Y0).conformalize(X0, Y0)
    b = model(random_state=1).fit(X0, Y0).conformalize(X0, Y0)
    assert np.array_equal(a.predict_set(X0)[1], b.predict_set(X0)[1])
    assert CERT.robust(np.int64(2), np.uint16(0)).shape == (8,)
    huge = X0.copy()
    huge[0] = 1e39
    torch_part = TorchPartClassifier(factory, epochs=2)
    with pytest.raises(ValueError, match="float32"):
        torch_part.fit(huge, Y0, K)
    with pytest.raises(ValueError, match="X holds complex numbers"):
        FITTED.predict_set(X0 + 1j)
    with pytest.raises(ValueError, match=r"n_train_parts=3 exceeds .*n_samples = 2"):
        model(n_train_parts=3).fit(X0[:2], [0, 1])


ATTACK_FIELDS = {
    "RandomFlip": ["fraction"],
    "PairFlip": ["source", "target", "fraction"],
    "TargetedFlip": ["flips"],
    "CalibrationCoverage": ["fraction"],
    "CalibrationSize": ["fraction"],
    "WorstCase": ["n_train_parts", "n_calib_parts", "train_parts", "copies"],
}
CONFIGS = [
    *((attack, ATTACK_FIELDS[attack.__name__]) for attack in ATTACKS),
    (SplitConformalLearner, ["confidence_level", "C"]),
    (RPS, ["n_train_parts", "n_calib_parts", "softmax", "quantile"]),
    (BaggingEnsemble, ["n_models"]),
    (
        ConformalPoisoning,
        ["confidence_level", "train_fraction", "n_targets", "subsample"],
    ),
]


@rule_settings()
@given(value=bad_reals())
def test_harness_configs(value):
    """Every numeric field of the harness's attacks, arms and scenario."""
    for config, fields in CONFIGS:
        for field in fields:
            assert_rule(lambda config=config, f=field: config(**{f: value}), [field])


@rule_settings(10)
@given(value=bad_reals())
def test_benchmark_parameters(value):
    for run, key in (
        (coverage_study, "n_splits"),
        (coverage_study, "confidence_level"),
        (tradeoff, "n_calib_parts"),
        (performance, "repeats"),
    ):
        base = {"n_train_parts": 2, "n_calib_parts": 1, "n_splits": 1}
        if run is performance:
            base = {"n_points": 50, "n_train_parts": 2, "n_calib_parts": 1}
        params = {**base, key: value}
        if run is coverage_study and key == "n_splits" and isinstance(value, int):
            params[key] = min(value, 2) if value > 0 else value
        if run is performance and isinstance(value, int) and value > 3:
            continue  # a valid, merely long run
        assert_rule(lambda run=run, params=params: list(run(params, [0])), [key])


def test_default_partition_on_150_calibration_points_names_suggest_parts():
    """Issue 40: the defaults (10 calibration parts) do not fit 150 points; the
    error says what fits and names suggest_parts, and what it names fits."""
    from defenses.data import load_digits

    d = load_digits()
    model = ReliableConformalClassifier(LogisticRegression(max_iter=300))
    model.fit(d.X[:800], d.y[:800])
    with pytest.raises(ValueError, match="suggest_parts") as error:
        model.conformalize(d.X[800:950], d.y[800:950])
    text = str(error.value)
    assert "n_calib=150" in text
    fits = int(text.split("n_calib_parts=")[-1].split(" ")[0])
    assert 1 <= fits < 10
    model.set_params(n_calib_parts=fits).conformalize(d.X[800:950], d.y[800:950])
    assert model.tau_hat_ >= 0
