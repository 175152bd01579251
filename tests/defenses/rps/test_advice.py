"""suggest_parts and the empty-certificate warning, on the data that exposed them."""

import itertools
import warnings

import numpy as np
import pytest
from sklearn.datasets import load_digits, make_classification
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split

from defenses.rps import (
    EmptyCertificateWarning,
    ReliableConformalClassifier,
    suggest_parts,
)
from defenses.rps.advice import calib_cap, small_part_risk
from defenses.rps.quantile import minimum_part_size


def _split(X, y):
    Xt, Xr, yt, yr = train_test_split(X, y, test_size=0.5, random_state=0, stratify=y)
    Xc, Xs, yc, ys = train_test_split(
        Xr, yr, test_size=0.5, random_state=0, stratify=yr
    )
    return (Xt, yt), (Xc, yc), (Xs, ys)


def lr():
    return LogisticRegression(max_iter=500)


def test_the_default_partition_warns_and_the_suggestion_certifies():
    # The case: 5 classes, 1,500 training points; the default 10 training
    # parts certify no test point against one poisoned training point.
    X, y = make_classification(
        3000, 20, n_informative=8, n_classes=5, class_sep=1.0, random_state=0
    )
    (Xt, yt), (Xc, yc), (Xs, _) = _split(X, y)
    default = ReliableConformalClassifier(lr(), n_calib_parts=1).fit(Xt, yt)
    with pytest.warns(EmptyCertificateWarning, match="n_train_parts=100"):
        default.conformalize(Xc, yc)
    assert default.certify(Xs).robust(1, 0).mean() == 0.0  # the warning was right
    plan = suggest_parts(len(yt), len(yc), 5, train_radius=1, calib_radius=0)
    assert plan.n_train_parts == 100
    assert plan.feasible
    better = ReliableConformalClassifier(
        lr(), n_train_parts=plan.n_train_parts, n_calib_parts=plan.n_calib_parts
    ).fit(Xt, yt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmptyCertificateWarning)
        better.conformalize(Xc, yc)
    assert better.certify(Xs).robust(1, 0).mean() > 0.4


@pytest.mark.parametrize(("k_t", "radius"), [(4, 1), (8, 2)])
def test_below_four_r_plus_one_parts_no_set_is_certified(k_t, radius):
    # The vote-margin rule behind suggest_parts, tried on a real model: with 4 r
    # training parts no set that is neither empty nor full withstands r poisons.
    X, y = load_digits(return_X_y=True)
    (Xt, yt), (Xc, yc), (Xs, _) = _split(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmptyCertificateWarning)
        below = ReliableConformalClassifier(lr(), n_train_parts=k_t, n_calib_parts=1)
        cert = below.fit(Xt, yt).conformalize(Xc, yc).certify(Xs)
        at = ReliableConformalClassifier(
            lr(), n_train_parts=4 * radius + 1, n_calib_parts=1
        )
        at_cert = at.fit(Xt, yt).conformalize(Xc, yc).certify(Xs)
    size = cert.sets.sum(axis=1)
    proper = (size > 0) & (size < cert.sets.shape[1])
    assert proper.sum() > 100
    assert not cert.robust(radius, 0)[proper].any()
    assert cert.robust(radius - 1, 0)[proper].mean() > 0.5 or radius == 1
    if radius == 1:
        assert at_cert.robust(1, 0).mean() > 0.5  # 5 parts already certify


@pytest.mark.parametrize("alpha", [0.1, 0.05])
@pytest.mark.parametrize("radius", [1, 2, 3])
def test_the_calibration_suggestion_is_the_smallest_that_can_reach_the_radius(
    alpha, radius
):
    plan = suggest_parts(2000, 3000, 10, 1, radius, 1 - alpha)
    k_c = plan.n_calib_parts
    assert calib_cap(k_c, alpha) >= radius > calib_cap(k_c - 1, alpha)
    assert plan.max_calib_radius == calib_cap(k_c, alpha)
    assert plan.min_calib_part == minimum_part_size(alpha, k_c, "exact")
    assert plan.feasible


def test_small_part_risk_bounds_the_hash_partition():
    rng = np.random.default_rng(0)
    n, k, size = 300, 10, 22
    sizes = rng.multinomial(n, np.full(k, 1 / k), size=20_000)
    observed = np.mean(sizes.min(axis=1) < size)
    assert observed <= small_part_risk(n, k, size)
    assert small_part_risk(n, k, size) < 1.0


def test_too_little_data_is_infeasible_and_says_how_much():
    plan = suggest_parts(60, 40, 3, train_radius=3, calib_radius=2)
    assert not plan.feasible
    assert plan.n_train_parts == 13  # at least 4 r_t + 1
    assert any("calibration points (have 40)" in note for note in plan.notes)
    assert any("13 training parts" in note for note in plan.notes)
    none = suggest_parts(1000, 500, 10, train_radius=0, calib_radius=0)
    assert (none.n_train_parts, none.n_calib_parts) == (1, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_train": 0}, "n_train"),
        ({"n_classes": 1}, "n_classes"),
        ({"train_radius": -1}, "train_radius"),
        ({"confidence_level": 1.0}, "confidence_level"),
        ({"quantile": "median"}, "quantile"),
        ({"max_train_parts": 0}, "max_train_parts"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    args = {"n_train": 800, "n_calib": 600, "n_classes": 10} | kwargs
    with pytest.raises(ValueError, match=match):
        suggest_parts(**args)


def _compositions(n, k):
    for cuts in itertools.combinations(range(n + k - 1), k - 1):
        parts, prev = [], -1
        for c in (*cuts, n + k - 1):
            parts.append(c - prev - 1)
            prev = c
        yield parts


class _TableVoter:
    """Parts voting by a table of vote counts: row ``X[i, 0]`` of ``table``."""

    def __init__(self, table, n_parts):
        self.table = np.asarray(table)
        self.n_parts = n_parts

    def part_votes(self, X):
        rows = self.table[np.asarray(X)[:, 0].astype(int)]
        out = np.empty((self.n_parts, len(rows)), dtype=np.int64)
        for j, counts in enumerate(rows):
            out[:, j] = np.repeat(np.arange(len(counts)), counts)
        return out


def _designs_certifying(k_t, radius, softmax, designs=20, k=3):
    """How many random calibration designs certify some non-trivial set at r."""
    rng = np.random.default_rng(0)
    tests = np.array(list(_compositions(k_t, k)))  # every vote vector of a point
    found = 0
    for _ in range(designs):
        cal = rng.multinomial(k_t, rng.dirichlet(np.full(k, 0.5), 40))
        labels = np.where(rng.random(40) < 0.85, cal.argmax(1), rng.integers(0, k, 40))
        voter = _TableVoter(np.vstack([cal, tests]), k_t)
        model = ReliableConformalClassifier.from_voter(
            voter, np.arange(k), 1, n_calib_parts=1, softmax=softmax
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmptyCertificateWarning)
            model.conformalize(np.arange(40.0)[:, None], labels)
        cert = model.certify((40.0 + np.arange(len(tests)))[:, None])
        size = cert.sets.sum(axis=1)
        proper = (size > 0) & (size < k)
        found += int(cert.robust(radius, 0)[proper].any())
    return found


@pytest.mark.parametrize("softmax", [False, True])
@pytest.mark.parametrize("radius", [1, 2])
def test_the_vote_margin_holds_for_every_vote_vector(softmax, radius):
    # Every vote vector of a test point against random calibration designs: with
    # 4 r parts no set that is neither empty nor full is certified at r (exact for
    # raw vote fractions, checked here for the softmax too), with 4 r + 1 some is.
    assert _designs_certifying(4 * radius, radius, softmax) == 0
    assert _designs_certifying(4 * radius + 1, radius, softmax) > 0
