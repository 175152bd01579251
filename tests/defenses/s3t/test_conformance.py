"""S3T checks the user's module before it trusts it (issue 27, part 2).

Each module of :mod:`tests.defenses.s3t.user_modules` is either refused at fit
with its cause named (functional dropout, noise in forward, buffers updated in
forward, NaN, float64), or fitted and served exactly: two predictions agree bit for
bit, delete + retrain equals a fresh fit, and the lineage audit is clean, until
the backbone is tampered with.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from defenses.s3t import S3T, SISA, FullRetrain, lineage_audit
from defenses.s3t.attacks import twin_test
from tests.defenses.s3t.user_modules import (
    ACCEPTED,
    REFUSED,
    SETTINGS,
    TokenModel,
    UserMLP,
    data,
)

X, Y, IDS = data()


def _make(module: torch.nn.Module) -> S3T:
    return S3T(module, 2, 2, rank=2, epochs=1, batch_size=16, **SETTINGS)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_modules_that_break_exactness_are_refused_at_fit_by_cause(name: str) -> None:
    make, phrase = REFUSED[name]
    with pytest.raises((ValueError, TypeError), match="model") as error:
        _make(make()).fit(X, Y, IDS)
    assert phrase.lower() in str(error.value).lower()


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_conforming_modules_are_served_exactly(name: str) -> None:
    module = ACCEPTED[name]()
    model = _make(module).fit(X, Y, IDS)
    np.testing.assert_array_equal(model.predict_proba(X), model.predict_proba(X))
    forget = IDS[[2, 9]]
    model.delete(forget)
    assert lineage_audit(model, forget.tolist()).clean
    model.retrain()
    keep = ~np.isin(IDS, forget)
    fresh = _make(ACCEPTED[name]()).fit(X[keep], Y[keep], IDS[keep])
    np.testing.assert_array_equal(model.predict_proba(X), fresh.predict_proba(X))


def test_the_functional_dropout_model_would_have_broken_the_twin_test() -> None:
    # what the conformance pass prevents: without it the twin test is the only
    # witness (issue 27); here the eager module itself shows the randomness
    make, _ = REFUSED["functional-dropout"]
    module = make()
    xt = torch.as_tensor(X)
    with torch.no_grad():
        assert not torch.equal(module(xt), module(xt))
    with pytest.raises(ValueError, match="training=True"):
        twin_test(lambda: _make(make()), X, Y, IDS, int(IDS[0]))


def test_lineage_audit_reports_a_backbone_that_moved_after_fit() -> None:
    model = _make(UserMLP()).fit(X, Y, IDS)
    report = lineage_audit(model, [])
    assert report.clean
    assert report.backbone_intact
    with torch.no_grad():
        model.backbone.fc1.weight[0, 0] += 1e-3  # tampered, or written by a stage
    report = lineage_audit(model, [])
    assert not report.backbone_intact
    assert not report.clean
    assert not report.offenders  # S3T's own records still look clean


def test_buffer_updates_are_allowed_only_in_the_negative_control() -> None:
    make, _ = REFUSED["batch-norm-in-forward"]
    settings = {**SETTINGS, "allow_shared_state": True}
    control = S3T(make(), 2, 2, rank=2, epochs=1, batch_size=16, **settings)
    with pytest.raises(ValueError, match="buffer 'mean'"):
        control.fit(X, Y, IDS)  # the control allows BatchNorm modules, not this


def test_train_mode_model_whose_batch_norm_is_in_eval_is_not_refused() -> None:
    module = ACCEPTED["batch-norm-eval-in-train-model"]()
    assert module.training
    assert not module.bn.training
    _make(module)  # no "training mode" refusal
    module.bn.train()
    with pytest.raises(ValueError, match=r"BatchNorm\) layers \['bn'\]"):
        _make(module)


def test_ids_as_pandas_series_and_object_arrays_are_accepted() -> None:
    names = pd.Series([f"user-{i}" for i in IDS])
    model = _make(UserMLP()).fit(X, pd.Series(Y), names)
    receipt = model.delete(pd.Series(["user-100", "user-101"]))
    assert receipt.ids == ("user-100", "user-101")
    objects = np.array(IDS.tolist(), dtype=object)
    by_object = _make(UserMLP()).fit(X, Y, objects)
    plain = _make(UserMLP()).fit(X, Y, IDS)
    np.testing.assert_array_equal(by_object.predict_proba(X), plain.predict_proba(X))
    assert by_object.delete(np.array([100], dtype=object)).ids == (100,)
    mixed = np.array([*IDS[:-1].tolist(), "x"], dtype=object)
    with pytest.raises(ValueError, match="all integers or all strings, got str 'x'"):
        _make(UserMLP()).fit(X, Y, mixed)


def test_float64_model_error_names_its_dtype_not_x() -> None:
    with pytest.raises(ValueError, match=r"^model: .*torch\.float64.*model\.float\(\)"):
        _make(UserMLP().double())


def test_token_ids_and_positional_embeddings_are_told_apart() -> None:
    tokens = np.random.default_rng(1).integers(0, 20, (48, 5))
    model = _make(TokenModel()).fit(tokens, Y, IDS)
    assert model.predict(tokens[:4]).shape == (4,)
    with pytest.raises(ValueError, match="integer token ids"):
        model.predict(tokens[:4].astype(np.float64))
    with pytest.raises(ValueError, match=r"X token ids must lie in \[0, 20\)"):
        model.predict(tokens[:4] + 20)
    positional = _make(ACCEPTED["positional-embedding"]()).fit(X, Y, IDS)
    assert positional.predict(X[:3]).shape == (3,)
    # integer features for the positional model are features, cast to float32
    ints = np.rint(X * 3).astype(np.int64)
    assert positional.predict(ints[:3]).shape == (3,)


@pytest.mark.parametrize("kind", ["SISA", "FullRetrain"])
def test_the_baselines_run_the_same_conformance_pass(kind: str) -> None:
    make, _ = REFUSED["functional-dropout"]
    model = (
        SISA(make(), 2, 2, rank=2, epochs=1, batch_size=16, **SETTINGS)
        if kind == "SISA"
        else FullRetrain(make(), rank=2, epochs=1, batch_size=16, **SETTINGS)
    )
    with pytest.raises(ValueError, match="training=True"):
        model.fit(X, Y, IDS)
