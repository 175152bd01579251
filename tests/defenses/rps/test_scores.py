import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from defenses.rps.scores import smoothed_scores, vote_counts, vote_geometry


def compositions(k, classes):
    for cut in itertools.combinations(range(k + classes - 1), classes - 1):
        edges = (-1, *cut, k + classes - 1)
        yield tuple(edges[i + 1] - edges[i] - 1 for i in range(classes))


def score(v, k, y, softmax):
    f = np.asarray(v) / k
    return float(np.exp(f[y]) / np.exp(f).sum()) if softmax else float(f[y])


@pytest.mark.parametrize("softmax", [True, False])
def test_bounds_equal_brute_force(softmax):
    for k in range(1, 6):
        for classes in range(2, 5):
            allv = np.array(list(compositions(k, classes)))
            g = vote_geometry(allv, k, softmax)
            for r in range(k + 2):
                upper = g.upper(r)[g.index]
                lower = g.lower(r)[g.index]
                for a, v in enumerate(allv):
                    reach = [w for w in allv if np.maximum(0, v - w).sum() <= r]
                    for y in range(classes):
                        s = [score(w, k, y, softmax) for w in reach]
                        assert upper[a, y] == pytest.approx(max(s), abs=1e-12)
                        assert lower[a, y] == pytest.approx(min(s), abs=1e-12)


@pytest.mark.parametrize("softmax", [True, False])
def test_bounds_with_abstentions_equal_brute_force(softmax):
    """Every (votes, abstentions) state and every change of r parts (K + 1 states)."""
    for k in range(1, 6):
        for classes in range(2, 5):
            states = np.array(list(compositions(k, classes + 1)))
            allv, abstained = states[:, :classes], states[:, classes]
            g = vote_geometry(allv, k, softmax, abstain=True)
            assert np.array_equal(g.score()[g.index].shape, allv.shape)
            scores = np.array(
                [[score(w, k, y, softmax) for y in range(classes)] for w in allv]
            )
            cost = np.maximum(0, states[:, None, :] - states[None, :, :]).sum(axis=2)
            for r in range(k + 2):
                reach = cost[:, :, None] <= r
                high = np.where(reach, scores[None], -np.inf).max(axis=1)
                low = np.where(reach, scores[None], np.inf).min(axis=1)
                assert np.allclose(g.upper(r)[g.index], high, rtol=0, atol=1e-12)
                assert np.allclose(g.lower(r)[g.index], low, rtol=0, atol=1e-12)
            assert abstained.max() == k


def test_no_abstention_gives_the_same_geometry():
    states = np.array(list(compositions(4, 3)))
    plain = vote_geometry(states, 4)
    open_ = vote_geometry(states, 4, abstain=True)
    for r in range(6):
        assert np.array_equal(plain.upper(r), open_.upper(r))
        assert np.array_equal(plain.lower(r), open_.lower(r))


def test_abstaining_predictions_are_counted_for_no_class():
    votes = vote_counts(np.array([[0, -1, 2], [-1, -1, 2], [1, 0, -1]]), 3, True)
    assert votes.tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 2]]
    with pytest.raises(ValueError, match="predictions must lie"):
        vote_counts(np.array([[0, -1]]), 3)
    with pytest.raises(ValueError, match="at most n_voters"):
        vote_geometry(np.array([[2, 2]]), 3, abstain=True)


def test_points_with_the_same_vote_multiset_share_entries():
    g = vote_geometry(np.array([[3, 1, 0], [0, 1, 3], [1, 3, 0], [2, 2, 0]]), 4)
    assert g.size == 5
    assert g.index[0, 0] == g.index[1, 2] == g.index[2, 1]
    assert g.index[3, 0] == g.index[3, 1] != g.index[3, 2]
    assert np.allclose(g.score()[g.index][1], smoothed_scores([[0, 1, 3]], 4)[0])
    # 20 classes of 200 voters (a 153-bit row): rows are compared in full, shared
    wide = np.zeros((2, 20), dtype=np.int64)
    wide[:, 0] = 200
    assert vote_geometry(wide, 200).size == 2
    assert vote_geometry(wide, 200).index.tolist() == [[0] + [1] * 19] * 2


def test_golden_scores():
    s = smoothed_scores(np.array([[2, 0, 0]]), 2)
    e = np.e
    assert s[0] == pytest.approx([e / (e + 2), 1 / (e + 2), 1 / (e + 2)])
    assert smoothed_scores(np.array([[1, 1]]), 2, softmax=False)[0].tolist() == [
        0.5,
        0.5,
    ]


votes_strategy = st.integers(2, 6).flatmap(
    lambda k: st.lists(
        st.lists(st.integers(0, k - 1), min_size=7, max_size=7), min_size=1, max_size=8
    ).map(lambda rows: (np.array(rows).T, k))
)


@settings(max_examples=40, deadline=None)
@given(data=votes_strategy, softmax=st.booleans())
def test_bounds_are_monotone_and_bracket_the_score(data, softmax):
    predictions, k = data
    votes = vote_counts(predictions, k)
    g = vote_geometry(votes, predictions.shape[0], softmax)
    s = g.score()
    previous_low, previous_high = s, s
    for r in range(predictions.shape[0] + 1):
        low, high = g.lower(r), g.upper(r)
        assert np.all(low <= previous_low + 1e-12)
        assert np.all(high >= previous_high - 1e-12)
        previous_low, previous_high = low, high
    assert np.allclose(g.lower(0), s)
    assert np.allclose(g.upper(0), s)


@settings(max_examples=30, deadline=None)
@given(data=votes_strategy)
def test_scores_do_not_depend_on_class_order(data):
    predictions, k = data
    votes = vote_counts(predictions, k)
    perm = np.random.default_rng(k).permutation(k)
    a = smoothed_scores(votes, predictions.shape[0])
    b = smoothed_scores(votes[:, perm], predictions.shape[0])
    assert np.array_equal(a[:, perm], b)


def test_bad_votes():
    with pytest.raises(ValueError, match="sum to n_voters"):
        vote_geometry(np.array([[1, 1]]), 3)
    with pytest.raises(ValueError, match="shape"):
        vote_geometry(np.array([1, 1]), 2)
    with pytest.raises(ValueError, match="predictions must lie"):
        vote_counts(np.array([[0, 3]]), 3)
    with pytest.raises(ValueError, match="radius"):
        vote_geometry(np.array([[1, 1]]), 2).upper(-1)


def test_warmup_runs_every_kernel_path():
    """``python -m defenses.jit`` compiles RPS's kernels through this module."""
    from defenses.jit import WARMUPS
    from defenses.rps import warmup

    assert "defenses.rps.warmup" in WARMUPS
    warmup.run()


def test_point_sets_equal_numpy_argmax_and_comparisons():
    """The compiled best class and sets: numpy's argmax (the first largest) and
    ``>=`` at each cut, with ties and entries shared by points."""
    from defenses.rps.entries import point_sets

    rng = np.random.default_rng(3)
    for n, k, levels in ((1, 2, 1), (50, 3, 2), (200, 10, 3)):
        scores = rng.choice([0.1, 0.2, 0.2, 0.5, 0.7], size=n * k)
        scores[rng.random(n * k) < 0.7] = 0.2  # many ties
        index = rng.permutation(n * k).reshape(n, k) % max(1, n * k - 3)
        cuts = np.sort(rng.choice([0.1, 0.2, 0.3], size=levels))
        best, sets = point_sets(scores, index, cuts)
        per_point = scores[index]
        assert best.tolist() == per_point.argmax(axis=1).tolist()
        assert np.array_equal(sets, per_point[:, :, None] >= cuts[None, None, :])
