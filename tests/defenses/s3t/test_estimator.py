from __future__ import annotations

import numpy as np
import pytest
import torch

from defenses.s3t import (
    S3T,
    SISA,
    AllShardsDeadError,
    FullRetrain,
    NotFittedError,
    ResidualMLP,
)
from defenses.s3t.attacks import lineage_audit


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fit_predict_and_probabilities(tiny, fast) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    proba = model.predict_proba(tiny.test_X)
    assert proba.shape == (len(tiny.test_y), 10)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-9)
    assert np.array_equal(model.predict(tiny.test_X), proba.argmax(axis=1))
    accuracy = float(np.mean(model.predict(tiny.test_X) == tiny.test_y))
    assert accuracy > 0.5
    assert model.served() == ((0, 1), (0, 1))


def test_same_seed_is_bit_identical_and_another_seed_differs(tiny, fast) -> None:
    a = S3T(tiny.backbone, 2, 2, seed=3, **fast).fit(tiny.X, tiny.y, tiny.ids)
    b = S3T(tiny.backbone, 2, 2, seed=3, **fast).fit(tiny.X, tiny.y, tiny.ids)
    c = S3T(tiny.backbone, 2, 2, seed=4, **fast).fit(tiny.X, tiny.y, tiny.ids)
    assert _same(a.active_state(), b.active_state())
    assert not _same(a.active_state(), c.active_state())


def test_stages_are_cached_by_prefix(tiny, fast) -> None:
    model = S3T(tiny.backbone, 1, 3, 6, **fast).fit(tiny.X, tiny.y, tiny.ids)
    prefixes = {p for _, p in model.stages()}
    expected = {o[:k] for o in model.orders for k in (1, 2, 3)}
    assert prefixes == expected
    assert len(prefixes) == 3 + 6 + 6


def test_s3t_trains_one_group_per_stage_and_sisa_all(tiny, fast) -> None:
    s3t = S3T(tiny.backbone, 1, 2, 1, **fast).fit(tiny.X, tiny.y, tiny.ids)
    sisa = SISA(tiny.backbone, 1, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)

    def blocks(model):
        return {
            p: {int(name.split(".")[1]) for name in st.adapters}
            for (_, p), st in model.stages().items()
        }

    assert blocks(s3t) == {(0,): {2, 3}, (0, 1): {0, 1}}
    assert blocks(sisa) == {(0,): {0, 1, 2, 3}, (0, 1): {0, 1, 2, 3}}
    assert all(len(st.adapters) == 4 for st in s3t.stages().values())


def test_delete_switches_off_exactly_the_stages_that_saw_the_point(tiny, fast) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    target = int(tiny.ids[5])
    ((shard, slc),) = model.locate([target])
    receipt = model.delete([target])
    assert receipt.slots == ((shard, slc),)
    assert receipt.deactivated
    assert all(s == shard and slc in p for s, p in receipt.deactivated)
    assert not any(s == shard and slc in p for s, p in model.stages())
    served = receipt.served[shard]
    assert slc not in served
    assert len(served) == 1
    assert not receipt.needs_retrain
    report = lineage_audit(model, [target])
    assert report.clean
    assert target not in model.training_ids()


def test_user_level_groups_share_one_slice(tiny, fast) -> None:
    groups = tiny.ids.copy()
    groups[:10] = -1
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids, groups)
    assert len(set(model.locate(tiny.ids[:10]))) == 1


def test_retrain_restores_exactly_a_fresh_fit_without_the_points(tiny, fast) -> None:
    gone = tiny.ids[[3, 40, 77]]
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    model.delete(gone)
    receipt = model.retrain()
    assert receipt.stages
    assert receipt.passes > 0
    keep = ~np.isin(tiny.ids, gone)
    fresh = S3T(tiny.backbone, 2, 2, **fast).fit(
        tiny.X[keep], tiny.y[keep], tiny.ids[keep]
    )
    assert _same(model.active_state(), fresh.active_state())
    assert model.served() == fresh.served()


def test_all_dead_refuses_to_predict_until_retrained(tiny, fast) -> None:
    model = SISA(tiny.backbone, 1, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    first = next(i for i in tiny.ids if model.locate([i])[0] == (0, 0))
    receipt = model.delete([first])
    assert receipt.all_dead
    assert receipt.needs_retrain
    assert receipt.dead_shards == (0,)
    with pytest.raises(AllShardsDeadError, match="retrain"):
        model.predict(tiny.test_X)
    model.retrain(only_dead=True)
    assert model.predict(tiny.test_X).shape == tiny.test_y.shape


def test_full_retrain_dies_at_every_deletion(tiny, fast) -> None:
    model = FullRetrain(tiny.backbone, **fast).fit(tiny.X, tiny.y, tiny.ids)
    assert model.delete([tiny.ids[0]]).all_dead


def test_lineage_records_exact_training_ids(tiny, fast) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    lineage = model.lineage()
    assert all(seen <= set(tiny.ids.tolist()) for seen in lineage.values())
    full = [k for k in lineage if k.startswith("shard0/prefix[0, 1]/")]
    first = [k for k in lineage if k.startswith("shard0/prefix[0]/")]
    assert lineage[first[0]] < lineage[full[0]]
    shard0 = {i for i in tiny.ids.tolist() if model.locate([i])[0][0] == 0}
    assert lineage[full[0]] == shard0


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m, t: m.delete([999_999]), KeyError, "unknown id"),
        (lambda m, t: m.delete([t.ids[0], t.ids[0]]), ValueError, "duplicate ids"),
        (lambda m, t: m.delete([]), ValueError, "no ids"),
        (lambda m, t: m.deactivate([(5, 0)]), ValueError, "out of range"),
        (lambda m, t: m.predict(np.full((2, 64), np.nan)), ValueError, "finite"),
        (lambda m, t: m.predict(np.zeros((2, 3))), ValueError, "shape"),
    ],
)
def test_bad_requests_leave_the_model_as_it_was(tiny, fast, call, error, match) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    before, served = model.active_state(), model.served()
    with pytest.raises(error, match=match):
        call(model, tiny)
    assert _same(before, model.active_state())
    assert model.served() == served


def test_already_deleted_id_is_reported_as_such(tiny, fast) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    model.delete([tiny.ids[1]])
    before = model.active_state()
    with pytest.raises(KeyError, match="already deleted"):
        model.delete([tiny.ids[2], tiny.ids[1]])
    assert _same(before, model.active_state())
    assert tiny.ids[2] in model.training_ids()


def test_predict_before_fit(tiny) -> None:
    with pytest.raises(NotFittedError, match="not fitted"):
        S3T(tiny.backbone).predict(tiny.test_X)


@pytest.mark.parametrize(
    ("kwargs", "fit", "match"),
    [
        ({}, lambda t: (t.X, t.y, np.r_[t.ids[:-1], t.ids[0]]), "duplicate ids"),
        ({"shards": 50, "slices": 4}, lambda t: (t.X, t.y, t.ids), "exceeds the 180"),
        ({}, lambda t: (t.X, t.y % 2, t.ids), "has 2 classes"),
        ({}, lambda t: (t.X, t.y + 0.5, t.ids), "continuous"),
        ({}, lambda t: (t.X, np.r_[t.y[:-1], np.nan], t.ids), "NaN"),
        ({}, lambda t: (t.X, np.zeros_like(t.y), t.ids), "single class"),
        ({}, lambda t: (t.X[:, :10], t.y, t.ids), "X: the ResidualMLP cannot take"),
        ({}, lambda t: (t.X + 1e39, t.y, t.ids), "finite in float32"),
        ({}, lambda t: (t.X[:0], t.y[:0], t.ids[:0]), "empty"),
        ({}, lambda t: (t.X, t.y, t.ids.astype(float)), "integers or strings"),
        ({"shards": 30, "slices": 4}, lambda t: (t.X, t.y, t.ids), "got no samples"),
    ],
)
def test_bad_fit_input(tiny, fast, kwargs, fit, match) -> None:
    model = S3T(tiny.backbone, **{"shards": 2, "slices": 2, **kwargs}, **fast)
    with pytest.raises(ValueError, match=match):
        model.fit(*fit(tiny))
    assert not model.fitted


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shards": 0}, "shards must be an int >= 1"),
        ({"slices": 9}, "slices=9 exceeds the 8 target layers"),
        ({"sequences": 0}, "sequences must be an int >= 1"),
        ({"selection": "random"}, "selection must be"),
        ({"slice_prior": [0.5, 0.5]}, "selection='bms' only"),
        ({"selection": "bms", "slice_prior": [1.0]}, "one value per slice"),
        ({"executor": "gpu"}, "executor must be one of"),
        ({"lr": 2.0}, "lr must be a finite number in"),
        ({"seed": -1}, "seed must be"),
    ],
)
def test_bad_hyper_parameters(tiny, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        S3T(tiny.backbone, **{"shards": 2, "slices": 2, **kwargs})


def test_backbone_with_shared_state_is_refused(tiny) -> None:
    leaky = ResidualMLP(64, 8, 8, 2, 10, norm="batch")
    with pytest.raises(ValueError, match="BatchNorm"):
        S3T(leaky.train(), 1, 2)
    S3T(leaky.eval(), 1, 2)
    with pytest.raises(ValueError, match="target_modules is required"):
        S3T(torch.nn.Linear(64, 10), 1, 2)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        S3T("not a model", 1, 2)  # type: ignore[arg-type]


def test_bms_orders_are_used(tiny, fast) -> None:
    model = S3T(
        tiny.backbone, 2, 4, 2, selection="bms", slice_prior=[0.7, 0.1, 0.1, 0.1]
    )
    assert all(o[0] != 0 for o in model.orders)
    assert all(o[-1] == 0 or o.index(0) >= 2 for o in model.orders)
