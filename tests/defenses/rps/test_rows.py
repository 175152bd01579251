"""The sorted-rows form of the vote geometry and the memo's word comparison.

``vote_geometry`` keeps the distinct sorted vote rows and no per-entry ``others``
(issue 42, fourth round): the kernels read an entry's others from its row. These
tests check that form against the entries built by hand (one row per entry), the
scores' shared prefix sums against :func:`entry_scores` bit for bit, the fused
calibration radius against the bisection of ``PartThresholds.calibration_radius``,
and that the geometry cannot be changed after the memo handed it out.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from defenses.rps.calibration import calibrate_parts
from defenses.rps.entries import entry_scores
from defenses.rps.parts import _same_bits
from defenses.rps.scores import VoteGeometry, canonical_scores, vote_geometry

from .test_radii_reference import random_votes

CASES = [(3, 2, False), (7, 4, True), (20, 10, False), (50, 10, True), (12, 6, False)]


def _hand_built(geometry: VoteGeometry) -> VoteGeometry:
    """The same entries, each its own row (the constructor's form)."""
    return VoteGeometry(
        geometry.own,
        geometry.others,
        geometry.index,
        geometry.scores,
        geometry.n_voters,
        geometry.softmax,
    )


@pytest.mark.parametrize(("k_t", "k", "abstain"), CASES)
def test_rows_hold_each_entry_and_its_sums(k_t: int, k: int, abstain: bool) -> None:
    """Rows sorted descending, one block of distinct counts each; the scores and
    tails from the rows' prefix sums equal ``entry_scores`` on the written-out
    entries, bit for bit (shifted by the row minimum with abstentions)."""
    rng = np.random.default_rng([k_t, k])
    votes = random_votes(rng, 400, k_t, k, abstain)
    geometry = vote_geometry(votes, k_t, True, abstain)
    rows, start = geometry.rows, geometry.start
    assert np.all(np.diff(rows, axis=1) <= 0)
    for r in range(rows.shape[0]):
        block = geometry.own[start[r] : start[r + 1]]
        assert block.tolist() == sorted(set(rows[r].tolist()), reverse=True)
    table = np.exp(np.arange(k_t + 2) / k_t)
    scores, tails = np.empty(geometry.size), np.empty(geometry.size)
    entry_scores(geometry.own, geometry.others, table, scores, tails)
    assert geometry.tails.tobytes() == tails.tobytes()
    want = canonical_scores(geometry.own, geometry.others, k_t, abstain)
    assert geometry.scores.tobytes() == want.tobytes()
    if not abstain:
        assert geometry.scores.tobytes() == scores.tobytes()


@pytest.mark.parametrize(("k_t", "k", "abstain"), CASES)
@pytest.mark.parametrize("softmax", [True, False])
def test_rows_and_entries_give_the_same_certificate(
    k_t: int, k: int, abstain: bool, softmax: bool
) -> None:
    """The fused pass (calibration, training and joint radii) on shared rows equals
    the same pass on one row per entry and the bisection of the calibration radius;
    bounds at every radius are bit-equal."""
    rng = np.random.default_rng([k_t, k, int(softmax)])
    votes = random_votes(rng, 300, k_t, k, abstain)
    geometry = vote_geometry(votes, k_t, softmax, abstain)
    by_hand = _hand_built(geometry)
    labels = rng.integers(0, k, 300)
    entries = geometry.index[np.arange(300), labels]
    parts = np.array_split(rng.permutation(300), 3)
    bounds = calibrate_parts(
        parts, entries, geometry, 0.2, "official", k_t
    ).part_thresholds
    got = geometry.certify_arrays(bounds)
    want = by_hand.certify_arrays(bounds)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    in_set = geometry.score() >= bounds.cut
    calibration = bounds.calibration_radius(geometry, in_set, 0)
    np.testing.assert_array_equal(got.calibration, calibration[geometry.index])
    assert got.training.max() >= 1
    for r in range(k_t + 2):
        for side in (geometry.lower, geometry.upper):
            name = side.__name__
            other = getattr(by_hand, name)(r)
            assert side(r).tobytes() == other.tobytes(), (name, r)


def test_geometry_is_immutable_and_pickles() -> None:
    """The memo hands one geometry to later calls: no attribute can be set; a
    pickled copy gives the same radii."""
    rng = np.random.default_rng(5)
    geometry = vote_geometry(random_votes(rng, 100, 10, 4, False), 10)
    with pytest.raises(AttributeError, match="immutable"):
        geometry.scores = np.zeros(geometry.size)
    with pytest.raises(AttributeError, match="immutable"):
        geometry.extra = 1
    copy = pickle.loads(pickle.dumps(geometry))
    assert copy.others.tolist() == geometry.others.tolist()
    assert copy.upper(3).tobytes() == geometry.upper(3).tobytes()


@pytest.mark.parametrize("size", [1, 7, 8, 63, 64, 65, 200, 640])
def test_same_bits_finds_any_changed_word(size: int) -> None:
    """The memo's comparison sees a change in any position (the 64-word blocks and
    the tail), -0.0 against 0.0, and sizes in bytes that are not a multiple of 8."""
    rng = np.random.default_rng(size)
    kept = rng.normal(size=(size, 3))
    assert _same_bits(kept, kept.copy())
    for at in {0, size // 2, size - 1}:
        changed = kept.copy()
        changed[at, 2] = np.nextafter(changed[at, 2], np.inf)
        assert not _same_bits(kept, changed)
    zero = np.zeros((size, 3))
    negative = zero.copy()
    negative[-1, -1] = -0.0
    assert not _same_bits(zero, negative)
    small = rng.integers(0, 100, size=(size, 3)).astype(np.int8)
    other = small.copy()
    other[-1, -1] += 1
    assert _same_bits(small, small.copy())
    assert not _same_bits(small, other)
