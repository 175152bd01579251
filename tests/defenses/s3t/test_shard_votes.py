"""Per-shard predictions: the votes a partitioned ensemble built on S3T uses."""

from __future__ import annotations

import numpy as np
import pytest

from defenses.s3t import S3T, SISA, AllShardsDeadError, NotFittedError


def _kill(model: S3T, shard: int) -> None:
    model.deactivate([(shard, j) for j in range(model.slices)])


def test_shape_dtype_and_labels(tiny, fast) -> None:
    model = S3T(tiny.backbone, 3, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    votes = model.shard_predictions(tiny.test_X)
    assert votes.shape == (3, len(tiny.test_y))
    assert votes.dtype == np.int64
    assert votes.min() >= 0
    assert votes.max() < 10
    assert np.array_equal(votes, model.shard_predictions(tiny.test_X))


def test_one_serving_shard_votes_like_predict(tiny, fast) -> None:
    model = S3T(tiny.backbone, 3, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    before = model.shard_predictions(tiny.test_X)
    _kill(model, 0)
    _kill(model, 2)
    votes = model.shard_predictions(tiny.test_X)
    assert np.all(votes[[0, 2]] == -1)
    assert np.array_equal(votes[1], before[1])
    assert np.array_equal(votes[1], model.predict(tiny.test_X))


def test_shards_differ_and_the_average_mostly_agrees(tiny, fast) -> None:
    model = S3T(tiny.backbone, 3, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    votes = model.shard_predictions(tiny.test_X)
    assert not np.array_equal(votes[0], votes[1])
    agree = np.mean(votes == model.predict(tiny.test_X)[None, :])
    assert agree > 0.5


def test_deleting_the_first_slices_of_a_shard_makes_it_abstain(tiny, fast) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    before = model.shard_predictions(tiny.test_X)
    slots = model.locate(tiny.ids)
    victims = [
        next(i for i, slot in zip(tiny.ids, slots, strict=True) if slot == (0, j))
        for j in range(2)
    ]
    model.delete(victims)
    votes = model.shard_predictions(tiny.test_X)
    assert np.all(votes[0] == -1)
    assert np.array_equal(votes[1], before[1])


def test_all_dead_abstains_where_predict_proba_refuses(tiny, fast) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    _kill(model, 0)
    _kill(model, 1)
    assert np.all(model.shard_predictions(tiny.test_X) == -1)
    with pytest.raises(AllShardsDeadError):
        model.predict_proba(tiny.test_X)


def test_sisa_has_shard_votes_too(tiny, fast) -> None:
    model = SISA(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    votes = model.shard_predictions(tiny.test_X[:7])
    assert votes.shape == (2, 7)
    assert votes.min() >= 0


def test_bad_input_and_unfitted_model_are_refused(tiny, fast) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast)
    with pytest.raises(NotFittedError):
        model.shard_predictions(tiny.test_X)
    model.fit(tiny.X, tiny.y, tiny.ids)
    with pytest.raises(ValueError, match="shape"):
        model.shard_predictions(tiny.test_X[:, :5])
    bad = tiny.test_X[:3].astype(float)
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        model.shard_predictions(bad)
