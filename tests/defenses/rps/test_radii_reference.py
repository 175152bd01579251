"""The one-pass radius scan gives the radii of the galloping search, bit for bit.

``defenses.rps.kernels.certified_radii`` replaced the galloping searches of
``largest_radius`` and ``training_and_joint`` (issue 42, item 3), and
``lower_bound`` reads the canonical sum ``tail[1]`` when no class is drained.
Their results are compared with the code they replaced
(:mod:`tests.defenses.rps.galloping_reference`) on random ensembles: with and
without abstaining parts, softmax and raw fractions, thresholds calibrated on
other points and on the test points themselves (exact ties between bounds and
thresholds), those thresholds moved by half the exclusion margin ``TIE``,
thresholds placed on an entry's own bound (exactly, and ``TIE / 2`` above), and
with the majority threshold and the deletion guard moved to the edges
(``keep_at`` past the last part, no calibration radius).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from defenses.rps.calibration import calibrate_parts
from defenses.rps.certificate import TIE, PartThresholds, certify_batch
from defenses.rps.entries import descending_rows
from defenses.rps.quantile import minimum_part_size
from defenses.rps.scores import VoteGeometry, _distinct_rows, vote_geometry
from tests.defenses.rps import galloping_reference as ref

SHAPES = [(1, 2), (2, 3), (3, 2), (5, 4), (8, 3), (13, 7), (20, 10), (50, 10)]


def random_votes(
    rng: np.random.Generator, n: int, k_t: int, k: int, abstain: bool
) -> np.ndarray:
    """Votes of ``n`` points: confident and spread ensembles, some abstentions."""
    p = rng.dirichlet(np.full(k, rng.choice([0.1, 0.5, 2.0])), size=n)
    votes = np.array([rng.multinomial(k_t, row) for row in p], dtype=np.int64)
    votes = votes.reshape(n, k)
    if abstain:
        drop = rng.integers(0, k_t + 1, size=n)
        for i in np.flatnonzero(rng.random(n) < 0.5):
            while drop[i] > 0 and votes[i].sum() > 0:
                c = rng.choice(np.flatnonzero(votes[i]))
                votes[i, c] -= 1
                drop[i] -= 1
    return votes


def thresholds_of(
    rng: np.random.Generator, geometry: VoteGeometry, n: int, k: int, k_t: int
) -> PartThresholds:
    """Thresholds calibrated on the batch behind ``geometry`` (random labels)."""
    labels = rng.integers(0, k, n)
    entries = geometry.index[np.arange(n), labels]
    alpha = float(rng.choice([0.05, 0.1, 0.2, 0.4]))
    k_c = int(rng.integers(1, 8))
    while k_c > 1 and n // k_c < minimum_part_size(alpha, k_c, "official"):
        k_c -= 1
    parts = np.array_split(rng.permutation(n), k_c)
    calibrated = calibrate_parts(parts, entries, geometry, alpha, "official", k_t)
    return calibrated.part_thresholds


def variants(rng: np.random.Generator, bounds: PartThresholds) -> list[PartThresholds]:
    """The calibrated thresholds, moved within TIE of the bounds (the exclusion
    margin decides), and with tau_hat / guard moved to the edges."""
    k_c = bounds.n_parts
    near = [
        PartThresholds(bounds.lower + d, bounds.upper + d, bounds.tau_hat, bounds.guard)
        for d in (TIE / 2, -TIE / 2)
    ]
    return [
        *near,
        bounds,
        dataclasses.replace(bounds, guard=int(rng.integers(-1, 3))),
        dataclasses.replace(bounds, tau_hat=k_c - 1, guard=k_c + 5),
        dataclasses.replace(bounds, tau_hat=0),
        bounds.truncated(int(rng.integers(0, bounds.radius + 1))),
    ]


def compare(
    geometry: VoteGeometry, bounds: PartThresholds, rng: np.random.Generator
) -> None:
    """Assert equal radii: training, joint, and ``largest`` below random ceilings."""
    tables = ref.Tables(
        bounds.lower,
        bounds.upper,
        bounds.tau_hat,
        bounds.guard,
        TIE,
        geometry.n_voters,
        geometry.softmax,
    )
    in_set = geometry.score() >= bounds.cut
    calibration = bounds.calibration_radius(geometry, in_set, 0)
    training, joint = geometry.radii(bounds, in_set, calibration)
    old_training, old_joint = ref.training_and_joint(
        geometry.own, geometry.others, in_set, bounds.radius, calibration, tables
    )
    np.testing.assert_array_equal(training, old_training)
    np.testing.assert_array_equal(joint, old_joint)
    ceiling = rng.integers(-1, bounds.radius + 3, size=geometry.size)
    capped = np.minimum(ceiling, bounds.radius)
    for is_joint in (False, True):
        got = geometry.largest(bounds, in_set, is_joint, ceiling)
        want = ref.largest_radius(
            geometry.own, geometry.others, in_set, capped, is_joint, tables
        )
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("softmax", [True, False])
@pytest.mark.parametrize("abstain", [False, True])
def test_radii_equal_the_galloping_search(
    seed: int, softmax: bool, abstain: bool
) -> None:
    rng = np.random.default_rng([seed, softmax, abstain])
    k_t, k = SHAPES[seed % len(SHAPES)]
    n = 120
    votes = random_votes(rng, n, k_t, k, abstain)
    geometry = vote_geometry(votes, k_t, softmax, abstain)
    other = random_votes(rng, n, k_t, k, abstain)
    # thresholds from other points, and from the test points themselves (ties)
    for source in (vote_geometry(other, k_t, softmax, abstain), geometry):
        bounds = thresholds_of(rng, source, n, k, k_t)
        for variant in variants(rng, bounds):
            compare(geometry, variant, rng)


def test_radii_equal_the_galloping_search_at_benchmark_shape() -> None:
    """k_t = 50 parts, 10 classes, confident and spread points (radii up to ~20)."""
    rng = np.random.default_rng(42)
    votes = random_votes(rng, 600, 50, 10, False)
    geometry = vote_geometry(votes, 50, True)
    bounds = thresholds_of(rng, geometry, 600, 10, 50)
    compare(geometry, bounds, rng)
    in_set = geometry.score() >= bounds.cut
    training = geometry.largest(bounds, in_set, False)
    assert training.max() >= 5  # large radii are reached, not only the first probes


@pytest.mark.parametrize("abstain", [False, True])
def test_bounds_equal_the_loop_sums(abstain: bool) -> None:
    """``lower_bound``'s ``tail[1]`` shortcut and both bounds, at every radius."""
    rng = np.random.default_rng(7)
    for k_t, k in SHAPES:
        votes = random_votes(rng, 80, k_t, k, abstain)
        geometry = vote_geometry(votes, k_t, True, abstain)
        tables = ref.Tables(np.zeros((1, 1)), np.zeros((1, 1)), 0, 0, TIE, k_t, True)
        for r in range(k_t + 2):
            for upper in (False, True):
                got = geometry.upper(r) if upper else geometry.lower(r)
                want = ref.bounds_at(geometry.own, geometry.others, r, upper, tables)
                assert got.tobytes() == want.tobytes(), (k_t, k, r, upper)


@pytest.mark.parametrize("member", [True, False])
def test_radii_at_a_threshold_on_the_entry_bound(member: bool) -> None:
    """One part whose threshold is an entry's own bound at radius ``r*``.

    Kept classes: the threshold equals the lower bound at ``r*`` exactly (kept,
    ``low >= cut``), so the radius is ``r*``. Left-out classes: the threshold lies
    ``TIE / 2`` above the upper bound at ``r*``, inside the exclusion margin, so
    the radius is ``r* - 1``. Both against the galloping search too.
    """
    rng = np.random.default_rng(3)
    votes = random_votes(rng, 200, 20, 4, False)
    geometry = vote_geometry(votes, 20, True)
    tried = 0
    for entry in rng.permutation(geometry.size)[:60]:
        star = int(rng.integers(1, 8))
        radii = np.arange(21)
        at = np.full(geometry.size, entry)
        if member:
            low = geometry.lower(radii, rows=at[:21])
            if low[star + 1] >= low[star]:
                continue  # the bound stalls (no votes left to move)
            upper = np.where(radii <= star, low[star], 2.0)[None, :]
            lower = np.where(radii == 0, low[star], 0.0)[None, :]
        else:
            high = geometry.upper(radii, rows=at[:21])
            if high[star] <= high[star - 1] or high[star] >= 1.0:
                continue
            lower = np.where(radii <= star, high[star] + TIE / 2, 0.0)[None, :]
            upper = np.where(radii == 0, lower[0, 0], 2.0)[None, :]
        bounds = PartThresholds(lower, upper, 0, 5)
        in_set = geometry.score() >= bounds.cut
        assert bool(in_set[entry]) == member
        got = geometry.largest(bounds, in_set, False)
        assert got[entry] == (star if member else star - 1)
        compare(geometry, bounds, rng)
        tried += 1
    assert tried >= 20


@pytest.mark.parametrize("abstain", [False, True])
def test_entries_of_each_point(abstain: bool) -> None:
    """``index`` (built through a count-to-rank table) names each class's entry.

    The entry of (point, class) holds the class's count as ``own`` and the
    point's other counts, sorted descending, as ``others``; the entries of one
    sorted vote vector are its distinct counts in descending order.
    """
    rng = np.random.default_rng(11)
    for k_t, k in SHAPES:
        votes = random_votes(rng, 150, k_t, k, abstain)
        geometry = vote_geometry(votes, k_t, True, abstain)
        for p in range(votes.shape[0]):
            ordered = sorted(votes[p].tolist(), reverse=True)
            distinct = sorted(set(ordered), reverse=True)
            first = geometry.index[p].min()
            for c in range(k):
                e = geometry.index[p, c]
                assert geometry.own[e] == votes[p, c]
                rest = list(ordered)
                rest.remove(int(votes[p, c]))
                assert geometry.others[e].tolist() == rest
                assert e - first == distinct.index(int(votes[p, c]))


@pytest.mark.parametrize("seed", range(6))
def test_certificate_and_sets_equal_the_numpy_code(seed: int) -> None:
    """The certificate's sets and its calibration radii at every training radius
    equal the numpy code the compiled bisection replaced."""
    rng = np.random.default_rng([seed, 5])
    k_t, k = SHAPES[(seed + 3) % len(SHAPES)]
    votes = random_votes(rng, 150, k_t, k, seed % 2 == 1)
    geometry = vote_geometry(votes, k_t, True, seed % 2 == 1)
    bounds = thresholds_of(rng, geometry, 150, k, k_t)
    cert = certify_batch(geometry, bounds, bounds.radius)
    thresholds = cert.thresholds
    index = geometry.index
    in_set = geometry.score() >= thresholds.cut
    np.testing.assert_array_equal(cert.sets, in_set[index])
    for r in range(bounds.radius + 1):
        scores = geometry.score()
        low = scores if r == 0 else geometry.lower(r)
        high = scores if r == 0 else geometry.upper(r)
        want = ref.calibration_radius(
            scores,
            low,
            high,
            in_set,
            thresholds.lower,
            thresholds.upper,
            r,
            thresholds.tau_hat,
            thresholds.guard,
            TIE,
        )
        np.testing.assert_array_equal(cert.calibration_radius(r), want[index])
        if r == 0:
            np.testing.assert_array_equal(cert.calibration, want[index])


def test_distinct_rows_as_numpy_unique() -> None:
    """The first row of each distinct sorted vote vector, in key order, as
    ``numpy.unique(keys, return_index=True, return_inverse=True)`` gives them."""
    rng = np.random.default_rng(13)
    for n in (0, 1, 2, 7, 300):
        for k_t, k in SHAPES:
            votes = random_votes(rng, n, k_t, k, False)
            ordered = descending_rows(votes)
            rows, inverse = _distinct_rows(ordered, k_t)
            keys = ordered @ ((k_t + 1) ** np.arange(k - 1, -1, -1, dtype=np.int64))
            _, first, where = np.unique(keys, return_index=True, return_inverse=True)
            np.testing.assert_array_equal(rows, first)
            np.testing.assert_array_equal(inverse, where.ravel())
            np.testing.assert_array_equal(ordered[rows[inverse]], ordered)


def test_geometry_built_by_hand_computes_its_tails() -> None:
    """A ``VoteGeometry`` made without ``tails`` sums them as ``vote_geometry``."""
    rng = np.random.default_rng(17)
    votes = random_votes(rng, 200, 20, 6, False)
    geometry = vote_geometry(votes, 20, True)
    fields = (geometry.own, geometry.others, geometry.index, geometry.scores)
    by_hand = VoteGeometry(*fields, geometry.n_voters, geometry.softmax)
    assert by_hand.tails is not None
    assert geometry.tails is not None
    assert by_hand.tails.tobytes() == geometry.tails.tobytes()
    bounds = thresholds_of(rng, geometry, 200, 6, 20)
    in_set = geometry.score() >= bounds.cut
    calibration = bounds.calibration_radius(geometry, in_set, 0)
    for got, want in zip(
        by_hand.radii(bounds, in_set, calibration),
        geometry.radii(bounds, in_set, calibration),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    assert geometry.radii(bounds, in_set, calibration)[0].max() >= 2
