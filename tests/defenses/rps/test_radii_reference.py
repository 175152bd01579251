"""The one-pass radius scan gives the radii of the galloping search, bit for bit.

``defenses.rps.kernels.certified_radii`` replaced the galloping searches of
``largest_radius`` and ``training_and_joint`` (issue 42, item 3), and ``lower_bound``
reads the canonical sum ``tail[1]`` when no class is drained. Their results are compared
with those of the code they replaced, stored in ``golden/radii.npz`` (inputs and
outputs, written at commit d9279ef by ``golden/generate.py`` from
``galloping_reference.py``, both removed since; check that commit out to run it) on
random ensembles: with and without abstaining parts, softmax and raw fractions,
thresholds calibrated on other points and on the test points themselves (exact ties
between bounds and thresholds), those thresholds moved by half the exclusion margin
``TIE``, and with the majority threshold and the deletion guard moved to the edges
(``keep_at`` past the last part, no calibration radius); the bounds at every radius (as
digests of their bits) and the old numpy calibration radius at every training radius.
Outputs are stored per (point, class), so the order of the entries is free.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from defenses.rps.calibration import calibrate_parts
from defenses.rps.certificate import TIE, PartThresholds, certify_batch
from defenses.rps.quantile import minimum_part_size
from defenses.rps.scores import VoteGeometry, vote_geometry

GOLDEN = Path(__file__).with_name("golden") / "radii.npz"
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


def ceiling_of(geometry: VoteGeometry, radius: int) -> np.ndarray:
    """A ceiling per entry in [-1, radius + 2], a function of its vote counts only
    (so it does not depend on the order of the entries)."""
    weights = 2 * np.arange(geometry.others.shape[1], dtype=np.int64) + 3
    key = 7 * geometry.own + geometry.others @ weights
    return np.asarray(key % (radius + 4) - 1, dtype=np.int64)


def digest(values: np.ndarray) -> np.ndarray:
    """The 16-byte BLAKE2b digest of an array's float64 bits (equal iff equal bits)."""
    data = np.ascontiguousarray(values, dtype=np.float64).tobytes()
    return np.frombuffer(hashlib.blake2b(data, digest_size=16).digest(), np.uint8)


def variants(bounds: PartThresholds, guard: int, cut: int) -> list[PartThresholds]:
    """The calibrated thresholds, moved within TIE of the bounds (the exclusion
    margin decides), and with tau_hat / guard moved to the edges (``guard`` and the
    truncation radius ``cut`` were drawn at random when the golden file was made)."""
    k_c = bounds.n_parts
    near = [
        PartThresholds(bounds.lower + d, bounds.upper + d, bounds.tau_hat, bounds.guard)
        for d in (TIE / 2, -TIE / 2)
    ]
    return [
        *near,
        bounds,
        dataclasses.replace(bounds, guard=guard),
        dataclasses.replace(bounds, tau_hat=k_c - 1, guard=k_c + 5),
        dataclasses.replace(bounds, tau_hat=0),
        bounds.truncated(cut),
    ]


class Golden:
    """``golden/radii.npz``: arrays stored flat, found through a JSON table."""

    def __init__(self, path: Path) -> None:
        with np.load(path) as data:
            self.table = json.loads(str(data["table"]))
            self.flat = {
                "i": data["ints"].astype(np.int64),
                "f": data["floats"],
                "d": data["digests"],
            }

    def __getitem__(self, name: str) -> np.ndarray:
        kind, offset, shape = self.table[name]
        size = int(np.prod(shape))
        return self.flat[kind][offset : offset + size].reshape(shape)

    def thresholds(self, name: str) -> PartThresholds:
        tau_hat, guard = self[f"{name}/ints"].tolist()
        lower, upper = self[f"{name}/lower"], self[f"{name}/upper"]
        return PartThresholds(lower, upper, tau_hat, guard)


@pytest.fixture(scope="module")
def golden() -> Golden:
    return Golden(GOLDEN)


def radii_of(geometry: VoteGeometry, bounds: PartThresholds) -> dict[str, np.ndarray]:
    """Training, joint and ``largest`` (below :func:`ceiling_of`) per (point, class)."""
    in_set = geometry.score() >= bounds.cut
    calibration = bounds.calibration_radius(geometry, in_set, 0)
    training, joint = geometry.radii(bounds, in_set, calibration)
    out = {"training": training, "joint": joint}
    ceiling = ceiling_of(geometry, bounds.radius)
    for is_joint in (False, True):
        out[f"largest{int(is_joint)}"] = geometry.largest(
            bounds, in_set, is_joint, ceiling
        )
    return {name: radii[geometry.index] for name, radii in out.items()}


def compare(
    geometry: VoteGeometry, bounds: PartThresholds, golden: Golden, name: str
) -> None:
    """Assert the radii equal the galloping search's, stored under ``name``."""
    for key, got in radii_of(geometry, bounds).items():
        np.testing.assert_array_equal(got, golden[f"{name}/{key}"], err_msg=key)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("softmax", [True, False])
@pytest.mark.parametrize("abstain", [False, True])
def test_radii_equal_the_galloping_search(
    seed: int, softmax: bool, abstain: bool, golden: Golden
) -> None:
    case = f"case/{seed}/{int(softmax)}/{int(abstain)}"
    k_t = SHAPES[seed % len(SHAPES)][0]
    geometry = vote_geometry(golden[f"{case}/votes"], k_t, softmax, abstain)
    # thresholds from other points, and from the test points themselves (ties)
    for source in (0, 1):
        bounds = golden.thresholds(f"{case}/{source}")
        guard, cut = golden[f"{case}/{source}/choices"].tolist()
        for v, variant in enumerate(variants(bounds, guard, cut)):
            compare(geometry, variant, golden, f"{case}/{source}/{v}")


def test_radii_equal_the_galloping_search_at_benchmark_shape(golden: Golden) -> None:
    """k_t = 50 parts, 10 classes, confident and spread points (radii up to ~20)."""
    geometry = vote_geometry(golden["bench/votes"], 50, True)
    bounds = golden.thresholds("bench")
    compare(geometry, bounds, golden, "bench")
    in_set = geometry.score() >= bounds.cut
    training = geometry.largest(bounds, in_set, False)
    assert training.max() >= 5  # large radii are reached, not only the first probes


@pytest.mark.parametrize("abstain", [False, True])
def test_bounds_equal_the_loop_sums(abstain: bool, golden: Golden) -> None:
    """``lower_bound``'s ``tail[1]`` shortcut and both bounds, at every radius."""
    for k_t, k in SHAPES:
        name = f"bounds/{int(abstain)}/{k_t}/{k}"
        geometry = vote_geometry(golden[f"{name}/votes"], k_t, True, abstain)
        for upper in (False, True):
            want = golden[f"{name}/{int(upper)}"]
            for r in range(k_t + 2):
                got = geometry.upper(r) if upper else geometry.lower(r)
                assert digest(got[geometry.index]).tolist() == want[r].tolist(), (
                    k_t,
                    k,
                    r,
                    upper,
                )


@pytest.mark.parametrize("member", [True, False])
def test_radii_at_a_threshold_on_the_entry_bound(member: bool) -> None:
    """One part whose threshold is an entry's own bound at radius ``r*``.

    Kept classes: the threshold equals the lower bound at ``r*`` exactly (kept,
    ``low >= cut``), so the radius is ``r*``. Left-out classes: the threshold lies
    ``TIE / 2`` above the upper bound at ``r*``, inside the exclusion margin, so
    the radius is ``r* - 1``.
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
def test_certificate_and_sets_equal_the_numpy_code(seed: int, golden: Golden) -> None:
    """The certificate's sets and its calibration radii at every training radius
    equal the numpy code the compiled bisection replaced."""
    name = f"calibration/{seed}"
    k_t = SHAPES[(seed + 3) % len(SHAPES)][0]
    geometry = vote_geometry(golden[f"{name}/votes"], k_t, True, seed % 2 == 1)
    bounds = golden.thresholds(name)
    cert = certify_batch(geometry, bounds, bounds.radius)
    in_set = geometry.score() >= cert.thresholds.cut
    np.testing.assert_array_equal(cert.sets, in_set[geometry.index])
    want = golden[f"{name}/radii"]
    assert want.shape[0] == bounds.radius + 1
    for r in range(bounds.radius + 1):
        np.testing.assert_array_equal(cert.calibration_radius(r), want[r])
    np.testing.assert_array_equal(cert.calibration, want[0])


@pytest.mark.parametrize(("k_t", "k"), [*SHAPES, (1000, 10), (3, 12)])
def test_points_with_one_sorted_row_share_its_entries(k_t: int, k: int) -> None:
    """One block of entries per distinct sorted vote vector, whatever its key's
    size (k_t = 1000, 10 classes: 100 bits), shared by all its points; rows with
    many repeats fill the hash table's probe chains."""
    rng = np.random.default_rng([k_t, k])
    for n in (0, 1, 2, 7, 3000):
        votes = random_votes(rng, n, k_t, k, False)
        geometry = vote_geometry(votes, k_t, True)
        rows = {tuple(sorted(row, reverse=True)) for row in votes.tolist()}
        assert geometry.size == sum(len(set(row)) for row in rows)
        firsts: dict[tuple[int, ...], int] = {}
        for p, row in enumerate(votes.tolist()):
            first = int(geometry.index[p].min())
            assert firsts.setdefault(tuple(sorted(row, reverse=True)), first) == first


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
