import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from defenses.rps.partition import part_of, partition

X = np.random.default_rng(0).random((200, 5))
Y = np.random.default_rng(1).integers(0, 3, 200)


def test_parts_do_not_depend_on_order_or_labels():
    perm = np.random.default_rng(2).permutation(200)
    assert np.array_equal(part_of(X, 7)[perm], part_of(X[perm], 7))
    parts = partition(X, Y, 7)
    shuffled = partition(X[perm], Y[perm], 7)
    for a, b in zip(parts, shuffled, strict=True):
        assert np.array_equal(X[a], X[perm][b])
        assert np.array_equal(Y[a], Y[perm][b])


def test_label_flip_keeps_part_and_insertion_touches_one():
    flipped = Y.copy()
    flipped[:10] = (flipped[:10] + 1) % 3
    before = [set(p.tolist()) for p in partition(X, Y, 5)]
    after = [set(p.tolist()) for p in partition(X, flipped, 5)]
    assert before == after
    extra = np.vstack([X, np.full((1, 5), 0.123)])
    grown = partition(extra, np.append(Y, 0), 5)
    changed = [i for i in range(5) if set(grown[i].tolist()) != before[i]]
    assert len(changed) == 1


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 20))
def test_partition_is_a_partition(k):
    parts = partition(X, Y, k)
    assert sorted(np.concatenate(parts).tolist()) == list(range(200))
    for p in parts:
        keys = np.column_stack([Y[p], X[p]])
        assert all(tuple(keys[i]) <= tuple(keys[i + 1]) for i in range(len(p) - 1))


def test_bad_input():
    with pytest.raises(ValueError, match="exceeds the number of samples"):
        partition(X[:3], Y[:3], 4)
    with pytest.raises(ValueError, match="received no sample"):
        partition(np.zeros((5, 2)), np.zeros(5), 2)
    bad = X.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        part_of(bad, 3)
    with pytest.raises(ValueError, match="n_parts"):
        part_of(X, 0)
