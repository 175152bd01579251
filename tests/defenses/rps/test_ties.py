"""Every comparison of the certificate and every rank leans to the safe side (issue 39).

A tolerance may shrink a radius or grow a set, never the reverse. Checked at exact
ties and at scores a few ulps either side (``np.nextafter``), against the rule with
exact comparisons, which is the truth of the floating-point world the sets live in.
"""

import itertools
from fractions import Fraction
from math import comb

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from defenses.rps.certificate import TIE, PartThresholds, ProbaGeometry
from defenses.rps.quantile import (
    exact_alpha,
    majority_threshold,
    official_rank,
    part_rank,
    textbook_rank,
)
from defenses.rps.scores import smoothed_scores, vote_geometry


def ulps(x, steps):
    """``x`` moved ``steps`` representable floats up (or down, if negative)."""
    direction = np.inf if steps > 0 else -np.inf
    for _ in range(abs(steps)):
        x = np.nextafter(x, direction)
    return float(x)


def reference_radius(score, thresholds, tau_hat, guard):
    """Largest r_c keeping the membership, from exact comparisons (-1: none).

    A poisoned calibration part can set its threshold anywhere: to remove a member,
    the attacker takes parts that keep it; to add a class, parts that leave it out.
    """
    k_c = thresholds.size
    keep = int(np.sum(score >= thresholds))
    member = score >= np.sort(thresholds)[tau_hat]
    radius = keep - tau_hat - 1 if member else tau_hat - keep
    assert (keep > tau_hat) == member
    return -1 if radius < 0 else min(radius, guard), member, k_c


def part_thresholds(values, tau_hat, guard=50):
    column = np.sort(np.asarray(values, dtype=np.float64))[:, None]
    return PartThresholds(column, column.copy(), tau_hat, guard)


def test_point_just_below_a_threshold_gets_no_extra_calibration_radius():
    """Issue 39's constructed case: 3.2e-11 below a part's threshold."""
    parts = part_thresholds([0.30, 0.40, 0.50], tau_hat=0)
    score = 0.40 - 3.2e-11
    geometry = ProbaGeometry(np.array([[score, 1.0 - score]]))
    in_set = geometry.score() >= parts.cut
    radius = parts.calibration_radius(geometry, in_set, 0)
    assert in_set[0]
    assert radius[0] == 0  # only the 0.30 part keeps it: one relabelled part removes it
    assert not parts.certified(geometry, in_set, 0, 1)[0]
    assert parts.certified(geometry, in_set, 0, 0)[0]


def test_distinct_vote_scores_2e_13_apart_are_ordered():
    """k_t = 50, K = 10: two distinct vote scores 2.2e-13 apart (measured by
    enumerating all 378,666 entries, see docs/rps.md); the lower one is not kept
    by a part whose threshold is the higher one, whatever the tolerance."""
    votes = np.array(
        [[0, 13, 11, 8, 8, 8, 2, 0, 0, 0], [1, 35, 8, 1, 1, 1, 1, 1, 1, 0]]
    )
    scores = smoothed_scores(votes, 50)
    low, high = scores[0, 0], scores[1, 0]
    assert 0 < high - low < 1e-12
    parts = part_thresholds([low / 2, high, 0.9], tau_hat=0)
    geometry = vote_geometry(votes[:1], 50)
    in_set = geometry.score() >= parts.cut
    entry = geometry.index[0, 0]
    assert in_set[entry]
    assert parts.calibration_radius(geometry, in_set, 0)[entry] == 0
    assert not parts.certified(geometry, in_set, 0, 1)[entry]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    values=st.lists(
        st.floats(0.01, 0.99, allow_nan=False), min_size=1, max_size=8, unique=True
    ),
    data=st.data(),
    steps=st.integers(-4, 4),
)
def test_calibration_radius_never_exceeds_the_exact_rule(values, data, steps):
    """Scores at a threshold and a few ulps either side: the radius the certificate
    gives is at most the exact one, equal on the inclusion side (no tolerance
    there) and within TIE of a threshold only ever smaller on the exclusion side."""
    k_c = len(values)
    tau_hat = data.draw(st.integers(0, k_c - 1))
    guard = data.draw(st.integers(0, 6))
    anchor = data.draw(st.sampled_from(values))
    score = ulps(anchor, steps)
    parts = part_thresholds(values, tau_hat, guard)
    geometry = ProbaGeometry(np.array([[score, 1.0 - score]]))
    in_set = geometry.score() >= parts.cut
    radius = int(parts.calibration_radius(geometry, in_set, 0)[0])
    expected, member, _ = reference_radius(score, np.asarray(values), tau_hat, guard)
    assert bool(in_set[0]) == member
    assert radius <= expected
    if member or np.min(np.abs(np.asarray(values) - score)) > TIE:
        assert radius == expected
    for r_c in range(guard + 2):
        certified = bool(parts.certified(geometry, in_set, 0, r_c)[0])
        assert certified == (0 <= r_c <= radius)


def compositions(k, classes):
    for cut in itertools.combinations(range(k + classes - 1), classes - 1):
        edges = (-1, *cut, k + classes - 1)
        yield tuple(edges[i + 1] - edges[i] - 1 for i in range(classes))


@pytest.mark.parametrize(("k", "classes"), [(4, 3), (6, 3), (5, 4), (7, 2)])
def test_bounds_are_bit_equal_to_the_score_they_reach(k, classes):
    """The kernels' bounds are the canonical score of a reachable vote vector, bit
    for bit, so an exact tie between a bound and a threshold is a tie in floats."""
    allv = np.array(list(compositions(k, classes)))
    scores = smoothed_scores(allv, k)
    geometry = vote_geometry(allv, k)
    for r in range(k + 1):
        upper = geometry.upper(r)[geometry.index]
        lower = geometry.lower(r)[geometry.index]
        for a, v in enumerate(allv):
            reach = np.maximum(0, v - allv).sum(axis=1) <= r
            assert np.array_equal(upper[a], scores[reach].max(axis=0))
            assert np.array_equal(lower[a], scores[reach].min(axis=0))
    assert np.array_equal(geometry.upper(0), geometry.score())
    assert np.array_equal(geometry.lower(0), geometry.score())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    k=st.integers(2, 7),
    classes=st.integers(2, 4),
    data=st.data(),
    steps=st.integers(-3, 3),
)
def test_training_radius_at_ties_and_ulps_either_side(k, classes, data, steps):
    """Thresholds placed at a test entry's own bounds and a few ulps off: the
    compiled search certifies exactly where the exact comparison does on the
    inclusion side, and never where it does not on the exclusion side."""
    allv = list(compositions(k, classes))
    v = np.array([data.draw(st.sampled_from(allv))])
    geometry = vote_geometry(v, k)
    radius = k
    entry = data.draw(st.integers(0, geometry.size - 1))
    r_at = data.draw(st.integers(0, radius))
    lows = geometry.lower(np.arange(radius + 1), rows=np.full(radius + 1, entry))
    highs = geometry.upper(np.arange(radius + 1), rows=np.full(radius + 1, entry))
    # one part, tau_hat = 0; its threshold bounds sit at the entry's bounds at r_at
    member_cut = ulps(lows[r_at], steps)
    out_cut = ulps(highs[r_at], steps)
    lower = np.full((1, radius + 1), 0.0)
    upper = np.full((1, radius + 1), 0.0)
    lower[0, :] = out_cut
    upper[0, :] = member_cut
    lower[0, 0] = upper[0, 0] = min(member_cut, out_cut)
    thresholds = PartThresholds(lower, upper, 0, 0)
    in_set = geometry.score() >= thresholds.cut
    got = geometry.largest(thresholds, in_set, joint=False)[entry]
    python = [True] + [
        bool(thresholds.certified(geometry, in_set, r, 0, rows=np.array([entry]))[0])
        for r in range(1, radius + 1)
    ]
    assert got == max(r for r in range(radius + 1) if all(python[: r + 1]))
    if in_set[entry]:
        exact = [r == 0 or lows[r] >= upper[0, r] for r in range(radius + 1)]
    else:  # the safe side: never certified where the exact rule is not
        exact = [r == 0 or highs[r] < lower[0, r] for r in range(radius + 1)]
    truth = max(r for r in range(radius + 1) if all(exact[: r + 1]))
    assert got <= truth
    if in_set[entry]:
        assert got == truth


@pytest.mark.parametrize(
    "level", [0.5, 0.75, 0.8, 0.9, 0.95, 0.98, 0.99, 0.7, 0.1, 0.3, 0.55, 0.999]
)
def test_ranks_are_exact_where_n_plus_one_alpha_is_whole(level):
    alpha = 1.0 - level
    exact = 1 - Fraction(str(level))
    assert exact_alpha(alpha) == exact
    whole = 0
    for n in range(1, 1100):
        product = (n + 1) * exact
        assert textbook_rank(n, alpha) == min(int(product), n)
        assert part_rank(n, alpha, 1, "exact") == textbook_rank(n, alpha)
        if product.denominator == 1 and product <= n:
            whole += 1
            assert textbook_rank(n, alpha) == product
            expected = max(0, min(int((product - 1) * (n - 1) / n) + 1, n))
            assert official_rank(n, alpha) == (expected if product >= 1 else 0)
    assert whole > 0


def test_majority_threshold_is_exact_binomial():
    for alpha in (1 - 0.95, 1 - 0.9, 1 - 0.8, 1 - 0.7):
        a = exact_alpha(alpha)
        for k_c in range(1, 45):
            cdf = Fraction(0)
            best = -1
            for t in range(k_c + 1):
                cdf += comb(k_c, t) * (1 - a) ** t * a ** (k_c - t)
                if cdf <= a:
                    best = t
            assert majority_threshold(k_c, alpha) == best
    assert majority_threshold(1, 1 - 0.95) == 0  # F(0) = alpha exactly


def partitions(n, parts, largest=None):
    """Vote vectors of ``n`` votes over ``parts`` classes, sorted descending."""
    largest = n if largest is None else largest
    if parts == 0:
        if n == 0:
            yield ()
        return
    for first in range(min(n, largest), -1, -1):
        if first * parts < n:
            break
        for rest in partitions(n - first, parts - 1, first):
            yield (first, *rest)


@pytest.mark.parametrize(
    ("k_t", "classes", "gap"), [(20, 10, 3e-8), (30, 10, 8e-10), (50, 10, 2e-13)]
)
def test_distinct_vote_scores_are_separated_beyond_rounding(k_t, classes, gap):
    """Every distinct vote score of the setting (all sorted vote vectors, every
    own count): no two distinct entries share a float, and the smallest gap
    between distinct scores is far above twice the rounding error of a score
    (at most (K + 3) eps: a rounded exponent argument and table entry, K - 1
    additions, one addition and one division), so exact comparisons order them as
    the real numbers are ordered (at k_t = 50, K = 10: 2.2e-13 against 5.8e-15)."""
    vectors = np.array(list(partitions(k_t, classes)), dtype=np.int64)
    geometry = vote_geometry(vectors, k_t)
    ordered = np.sort(geometry.scores)
    steps = np.diff(ordered)
    assert np.all(steps > 0)  # distinct entries, distinct floats
    assert gap / 2 < steps.min() < gap * 2
    assert steps.min() > 10 * 2 * (classes + 3) * np.finfo(np.float64).eps


def test_quadrature_error_is_far_below_the_margin():
    from scipy import special, stats

    from defenses.rps.quantile import QUADRATURE_MARGIN, _homogeneous_miss

    x, w = np.polynomial.legendre.leggauss(16)
    edges = np.linspace(0.0, 1.0, 1025)
    half, mid = np.diff(edges) / 2, (edges[:-1] + edges[1:]) / 2
    u = (mid[:, None] + half[:, None] * x).ravel()
    weights = (half[:, None] * w).ravel()
    worst = 0.0
    for alpha in (0.05, 0.1, 0.2):
        for k_c in (2, 5, 10, 20, 40):
            tau = majority_threshold(k_c, alpha)
            for n in (20, 60, 200, 1000):
                rank = textbook_rank(n, alpha)
                fine = np.dot(
                    weights,
                    stats.binom.cdf(tau, k_c, special.betainc(rank, n + 1 - rank, u)),
                )
                worst = max(worst, abs(_homogeneous_miss(rank, n, k_c, tau) - fine))
    assert worst < QUADRATURE_MARGIN / 100


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    k_t=st.integers(3, 14),
    classes=st.integers(2, 5),
    k_c=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_compiled_radii_equal_the_canonical_comparisons(k_t, classes, k_c, seed):
    """The radius search decides with constant-time bounds first and the canonical
    ones near a threshold (defenses/rps/fastbounds.py): its radii must equal the
    Python path's, which compares the canonical bounds, at every radius. Test and
    calibration points share vote vectors, so exact ties are frequent."""
    from defenses.rps.calibration import calibrate_parts

    rng = np.random.default_rng(seed)
    pool = np.array(list(compositions(k_t, classes)))
    cal = pool[rng.integers(0, len(pool), 20 * k_c)]
    test = pool[rng.integers(0, len(pool), 60)]
    cal_geometry = vote_geometry(cal, k_t)
    labels = rng.integers(0, classes, len(cal))
    entries = cal_geometry.index[np.arange(len(cal)), labels]
    parts = np.array_split(np.arange(len(cal)), k_c)
    thresholds = calibrate_parts(parts, entries, cal_geometry, 0.2, "official", k_t)
    bounds = thresholds.part_thresholds
    geometry = vote_geometry(test, k_t)
    in_set = geometry.score() >= bounds.cut
    calibration = bounds.calibration_radius(geometry, in_set, 0)
    training, joint = geometry.radii(bounds, in_set, calibration)
    for r in range(1, k_t + 1):
        assert np.array_equal(bounds.certified(geometry, in_set, r, 0), training >= r)
        both = bounds.certified(geometry, in_set, r, r)
        assert np.array_equal(both & (calibration >= r), joint >= r)
