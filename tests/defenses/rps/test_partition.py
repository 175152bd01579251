import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import sparse

from defenses.rps.partition import hash_rows, part_of, partition

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
    with pytest.raises(ValueError, match="n_parts"):
        part_of(X, 0)
    with pytest.raises(ValueError, match="n_parts"):
        part_of(X, 2.5)
    with pytest.raises(ValueError, match="complex"):
        part_of(X.astype(complex), 3)


def test_canonical_hash_of_numbers():
    """-0.0 is 0.0, every NaN is one NaN, integers hash as the equal floats."""
    ints = np.array([[1, 2, 3], [4, 5, 6]])
    assert np.array_equal(hash_rows(ints), hash_rows(ints.astype(np.float32)))
    signed = np.array([[-0.0, 1.0], [np.nan, 2.0]])
    other_nan = np.array([[0.0, 1.0], [-np.nan, 2.0]])
    assert np.array_equal(hash_rows(signed), hash_rows(other_nan))
    assert part_of(np.array([[np.nan, 1.0]]), 3)[0] in (0, 1, 2)


def test_sparse_rows_hash_by_value_not_storage():
    dense = np.random.default_rng(4).random((60, 8))
    dense[dense < 0.6] = 0.0
    csr = sparse.csr_matrix(dense)
    coo = sparse.coo_matrix(dense)
    explicit = csr.copy()
    explicit.data[:5] = 0.0
    assert np.array_equal(hash_rows(csr), hash_rows(coo))
    zeroed = dense.copy()
    zeroed[np.nonzero(csr)[0][:5], np.nonzero(csr)[1][:5]] = 0.0
    assert np.array_equal(hash_rows(explicit), hash_rows(sparse.csr_matrix(zeroed)))
    perm = np.random.default_rng(5).permutation(60)
    assert np.array_equal(hash_rows(csr)[perm], hash_rows(csr[perm]))
    labels = np.arange(60) % 3
    parts = partition(csr, labels, 4)
    assert sorted(np.concatenate(parts).tolist()) == list(range(60))


def test_frames_hash_by_values_not_index():
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"city": ["a", "b", "c", "a"] * 10, "x": np.arange(40.0)})
    moved = frame.set_axis(np.arange(100, 140))
    assert np.array_equal(hash_rows(frame), hash_rows(moved))
    perm = np.random.default_rng(6).permutation(40)
    assert np.array_equal(hash_rows(frame)[perm], hash_rows(frame.iloc[perm]))
    labels = np.arange(40) % 2
    a = partition(frame, labels, 3)
    b = partition(frame.iloc[perm], labels[perm], 3)
    for rows_a, rows_b in zip(a, b, strict=True):
        assert frame.iloc[rows_a].equals(
            frame.iloc[perm].iloc[rows_b].set_axis(frame.iloc[rows_a].index)
        )


def test_object_rows_hash_by_value():
    rows = np.array([["a", 1], ["b", 2], ["a", 1]], dtype=object)
    hashes = hash_rows(rows)
    assert hashes[0] == hashes[2] != hashes[1]
