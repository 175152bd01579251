"""The bad-input rule on the S3T x RPS composition's entry points (issue 19)."""

import warnings

import numpy as np
import pytest
from hypothesis import given

from defenses.composition.benchmark.s3t_rps import Settings
from defenses.composition.s3t_rps import ReliableUnlearner, ShardVoter
from defenses.data import load_digits
from defenses.s3t import S3T
from defenses.s3t.backbone import pretrain
from defenses.testing import assert_rule, bad_arrays, bad_reals, rule_settings

DATA = load_digits()
ORDER = np.random.default_rng(0).permutation(len(DATA))[:700]
PUBLIC, POOL, CAL = ORDER[:150], ORDER[150:450], ORDER[450:]


def _unlearner():
    backbone = pretrain(
        DATA.X[PUBLIC],
        DATA.y[PUBLIC],
        np.random.default_rng(1),
        width=16,
        hidden=16,
        n_blocks=1,
        epochs=2,
    )
    return S3T(backbone, 4, 2, epochs=2, rank=2, lr=3e-2, batch_size=64)


@pytest.fixture(scope="module")
def fitted():
    model = ReliableUnlearner(_unlearner(), n_calib_parts=2, confidence_level=0.8)
    model.fit(DATA.X[POOL], DATA.y[POOL], ids=POOL)
    return model.conformalize(DATA.X[CAL], DATA.y[CAL])


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@rule_settings(10)
@given(X=bad_arrays((6, 64)))
def test_serving(fitted, X):
    n = X.shape[0] if X.ndim else 0

    def sets(result):
        _, y_set = result
        assert y_set.shape == (n, 10, 1)
        assert y_set.dtype == bool

    assert_rule(lambda: fitted.predict_set(X), ["X"], sets)
    assert_rule(lambda: fitted.certify(X), ["X"])
    assert_rule(lambda: fitted.part_votes(X), ["X"])


@rule_settings(10)
@given(value=bad_reals())
def test_parameters(fitted, value):
    unlearner = fitted.unlearner
    for name in ("n_calib_parts", "confidence_level"):
        assert_rule(
            lambda name=name: ReliableUnlearner(unlearner, **{name: value}), [name]
        )
    assert_rule(lambda: fitted.certify(DATA.X[:4], value), ["max_train_radius"])
    params = {"confidence_level": value}
    assert_rule(lambda: Settings.parse(params), ["confidence_level"])


def test_regressions(fitted):
    with pytest.raises(ValueError, match="unlearner"):
        ShardVoter(object())
    labels = DATA.y[CAL].astype(float)
    labels[0] = np.nan
    with pytest.raises(ValueError, match="y contains NaN"):
        fitted.conformalize(DATA.X[CAL], labels)
    with pytest.raises(ValueError, match="X holds complex numbers"):
        fitted.predict_set(DATA.X[:3] + 1j)
    with pytest.raises(ValueError, match="X: Found array with dim 3"):
        fitted.conformalize(DATA.X[CAL][:, :, None], DATA.y[CAL])
