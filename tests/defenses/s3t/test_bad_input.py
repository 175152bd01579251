"""The bad-input rule on every public entry point of S3T (issue 19).

Each call either returns a valid result (finite; probabilities of shape (n, K) on
the simplex; labels from ``classes_``; votes in ``-1 .. K-1``) or raises
ValueError/TypeError naming the parameter (:func:`defenses.testing.assert_rule`).
Few examples by default, ten times more with ``--runslow``.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from defenses.data import load_digits
from defenses.s3t import S3T, SISA, pretrain
from defenses.s3t.backbone import ResidualMLP
from defenses.testing import (
    VALID_NUMPY_SCALARS,
    assert_rule,
    bad_arrays,
    bad_reals,
    rule_settings,
)
from tests.defenses.s3t.user_modules import ACCEPTED, REFUSED, data
from tests.defenses.s3t.user_modules import CLASSES as UM_CLASSES
from tests.defenses.s3t.user_modules import FEATURES as UM_FEATURES
from tests.defenses.s3t.user_modules import SETTINGS as UM_SETTINGS

DATA = load_digits()
N, D = 48, 64
X0, Y0, IDS = DATA.X[:N], DATA.y[:N], np.arange(N) + 1000
BACKBONE = ResidualMLP(D, 8, 8, 2, 10).eval()
SETTINGS = {"epochs": 1, "batch_size": 32, "rank": 1}
FITTED = S3T(BACKBONE, 2, 2, **SETTINGS).fit(X0, Y0, IDS)
K = FITTED.classes_.size
UM_X, UM_Y, UM_IDS = data()
UM_N = UM_X.shape[0]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _rows(X: np.ndarray) -> int:
    return int(X.shape[0]) if X.ndim else 0


def simplex(n: int):
    def check(proba):
        assert proba.shape == (n, K)
        assert np.all(proba >= 0)
        np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-9)

    return check


def from_classes(n: int):
    def check(labels):
        assert labels.shape == (n,)
        assert set(labels.tolist()) <= set(FITTED.classes_.tolist())

    return check


def serves(model) -> None:
    """A fitted model answers with finite probabilities on clean inputs."""
    proba = model.predict_proba(X0[:5])
    assert np.isfinite(proba).all()
    simplex(5)(proba)


def finite_logits(X):
    """A pretrained backbone has finite logits on (the finite rows of) its data."""

    def check(backbone) -> None:
        import torch

        with torch.no_grad():
            logits = backbone(torch.as_tensor(X[:5], dtype=torch.float32))
        assert torch.isfinite(logits).all()

    return check


def votes(n: int):
    def check(result):
        assert result.shape == (2, n)
        assert result.min() >= -1
        assert result.max() < K

    return check


@rule_settings()
@given(X=bad_arrays((6, D)))
# finite in float32, but the served model's forward pass overflows: its logits held
# NaN and predict_proba returned NaN rows (found by a random run, 2026-12-06)
@example(X=np.full((6, D), 3.87685755e19))
def test_predictions(X) -> None:
    n = _rows(X)
    assert_rule(lambda: FITTED.predict_proba(X), ["X"], simplex(n))
    assert_rule(lambda: FITTED.predict(X), ["X"], from_classes(n))
    assert_rule(lambda: FITTED.shard_predictions(X), ["X"], votes(n))


@rule_settings(8)
@given(X=bad_arrays((N, D)))
def test_fit_features(X) -> None:
    n = _rows(X)
    labels, ids = np.arange(n) % 10, np.arange(n)
    params = ["X", "y", "ids", "shards"]
    model = S3T(BACKBONE, 2, 2, **SETTINGS)
    assert_rule(lambda: model.fit(X, labels, ids), params, serves)


@rule_settings(8)
@given(y=bad_arrays((N,)))
def test_fit_labels(y) -> None:
    def valid(model) -> None:
        assert model.classes_.size == K
        assert set(model.predict(X0[:5]).tolist()) <= set(np.unique(y).tolist())

    params = ["y", "model"]
    assert_rule(lambda: SISA(BACKBONE, 2, 2, **SETTINGS).fit(X0, y, IDS), params, valid)


@rule_settings()
@given(ids=st.one_of(bad_arrays((3,)), st.lists(st.integers(), max_size=3)))
def test_delete(ids) -> None:
    model = copy.deepcopy(FITTED)
    assert_rule(lambda: model.delete(ids), ["ids"])


@rule_settings()
@given(shard=bad_reals(), slc=bad_reals())
def test_deactivate(shard, slc) -> None:
    model = copy.deepcopy(FITTED)
    assert_rule(lambda: model.deactivate([(shard, slc)]), ["slots"])
    assert_rule(lambda: model.deactivate([shard]), ["slots"])


@rule_settings()
@given(value=bad_reals())
def test_hyper_parameters(value) -> None:
    for name in ("shards", "slices", "sequences", "rank", "epochs", "batch_size"):
        kwargs = {"shards": 2, name: value}
        assert_rule(lambda kw=kwargs: S3T(BACKBONE, **kw), [name])
    for name in ("lr", "seed", "n_jobs"):
        assert_rule(lambda kw={name: value}: S3T(BACKBONE, 2, 2, **kw), [name])
    assert_rule(
        lambda: S3T(BACKBONE, 2, 2, selection="bms", slice_prior=[value, 1.0]),
        ["slice_prior"],
    )
    assert_rule(lambda: FITTED.retrain(only_dead=value), ["only_dead"])


@rule_settings(8)
@given(X=bad_arrays((30, D)), value=bad_reals())
def test_pretrain(X, value) -> None:
    n = _rows(X)
    rng = np.random.default_rng(0)
    small = {"width": 4, "hidden": 4, "n_blocks": 1, "epochs": 1}
    assert_rule(
        lambda: pretrain(X, np.arange(n) % 3, rng, **small),
        ["X", "y"],
        finite_logits(X),
    )
    long = isinstance(value, int | np.integer) and not isinstance(value, bool)
    for name in ("epochs", "lr", "batch_size", "n_classes", "width"):
        if name == "epochs" and long and value > 2:
            continue  # a valid request for a long training: not bad input
        args = {**small, name: value}
        assert_rule(lambda kw=args: pretrain(X0[:20], Y0[:20], rng, **kw), [name])


@rule_settings()
@given(y=bad_arrays((20,)))
def test_pretrain_labels(y) -> None:
    small = {"width": 4, "hidden": 4, "n_blocks": 1, "epochs": 1}
    rng = np.random.default_rng(0)
    assert_rule(lambda: pretrain(X0[:20], y, rng, **small), ["y", "n_classes"])


def test_state_files_and_paths(tmp_path) -> None:
    (tmp_path / "junk.s3t").write_bytes(b"not a state")
    assert_rule(lambda: S3T(BACKBONE, 2, 2).load(tmp_path / "junk.s3t"), ["junk"])
    assert_rule(lambda: FITTED.save(12), ["path"])
    assert_rule(lambda: FITTED.save(tmp_path), ["path"])
    assert_rule(lambda: S3T(BACKBONE, 2, 2, store=3.5), ["path"])


# -- regression tests of the cases in issue 19 ------------------------------------


def test_inputs_that_overflow_float32_are_refused() -> None:
    huge = X0[:2] + 1e39  # finite in float64, inf in float32
    with pytest.raises(ValueError, match="X must be finite in float32"):
        FITTED.predict_proba(huge)
    with pytest.raises(ValueError, match="X must be finite in float32"):
        FITTED.predict(huge)
    with pytest.raises(ValueError, match="X must be finite in float32"):
        S3T(BACKBONE, 2, 2, **SETTINGS).fit(X0 + 1e39, Y0, IDS)


def test_pretrain_refuses_nan_features_and_fractional_labels() -> None:
    rng = np.random.default_rng(0)
    bad = X0[:20].copy()
    bad[3, 5] = np.nan
    with pytest.raises(ValueError, match="X must be finite"):
        pretrain(bad, Y0[:20], rng, width=4, hidden=4, n_blocks=1, epochs=1)
    fractional = Y0[:20].astype(float)
    fractional[0] = 1.7
    with pytest.raises(ValueError, match="y must hold integer class indices"):
        pretrain(X0[:20], fractional, rng, width=4, hidden=4, n_blocks=1, epochs=1)


def test_pretrain_infers_the_classes_and_binary_gives_two_columns() -> None:
    rng = np.random.default_rng(0)
    binary = pretrain(X0, Y0 % 2, rng, width=4, hidden=4, n_blocks=1, epochs=1)
    assert binary.n_classes == 2
    model = S3T(binary, 2, 2, **SETTINGS).fit(X0, np.where(Y0 % 2, "odd", "even"), IDS)
    assert model.predict_proba(X0[:3]).shape == (3, 2)
    assert list(model.classes_) == ["even", "odd"]


def test_numpy_scalars_are_accepted_everywhere(tmp_path) -> None:
    ints = [v for v in VALID_NUMPY_SCALARS if isinstance(v, np.integer)]
    model = S3T(
        BACKBONE,
        ints[0] * 2,
        ints[1],
        np.int64(2),
        np.int16(1),
        epochs=np.int32(1),
        batch_size=np.int64(32),
        lr=np.float32(0.01),
        seed=np.int64(1),
        store=tmp_path / "m.s3t",
    ).fit(X0, Y0, IDS)
    again = S3T(
        BACKBONE,
        2,
        2,
        2,
        1,
        epochs=1,
        batch_size=32,
        lr=float(np.float32(0.01)),
        seed=1,
    ).load(tmp_path / "m.s3t")
    np.testing.assert_array_equal(again.predict_proba(X0), model.predict_proba(X0))
    model.delete(np.array([IDS[0]], dtype=np.int32))
    assert IDS[0] not in model.training_ids()


USER_MODULES = {**{k: make for k, (make, _) in REFUSED.items()}, **ACCEPTED}
"""The family of user modules of issue 27 (functional dropout, noise and buffer
updates in forward, NaN, float64, positional embeddings, compiled)."""


@pytest.mark.parametrize("name", sorted(USER_MODULES))
@rule_settings(3)
@given(X=bad_arrays((UM_N, UM_FEATURES)))
def test_user_modules(name, X) -> None:
    def fit():
        model = S3T(USER_MODULES[name](), 2, 2, rank=1, epochs=1, **UM_SETTINGS)
        return model.fit(X, UM_Y, UM_IDS).predict_proba(UM_X[:4])

    assert_rule(fit, ["X", "model"], simplex_of(UM_CLASSES))


def simplex_of(k: int):
    def check(proba):
        assert proba.shape == (4, k)
        np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-9)

    return check
