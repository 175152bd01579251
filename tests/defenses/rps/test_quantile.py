import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from defenses.rps.quantile import (
    exact_rank,
    majority_miscoverage,
    majority_threshold,
    minimum_part_size,
    official_rank,
    part_rank,
    textbook_rank,
)

K_C = [1, 2, 3, 5, 10, 15, 20, 22, 25, 30, 40]


def test_majority_threshold_matches_the_notes_table():
    assert [majority_threshold(k, 0.1) for k in K_C] == [
        0,
        0,
        1,
        3,
        7,
        11,
        15,
        17,
        20,
        24,
        33,
    ]
    assert [majority_threshold(k, 0.05) for k in K_C] == [
        0,
        0,
        1,
        3,
        7,
        12,
        16,
        18,
        21,
        25,
        35,
    ]


def test_official_rank_is_one_below_textbook_at_n45():
    assert official_rank(45, 0.1) == 3
    assert textbook_rank(45, 0.1) == 4


def test_single_part_miscoverage_is_rank_over_n_plus_one():
    assert majority_miscoverage([60], [600], 0.1) == pytest.approx(60 / 601, abs=1e-9)


def test_textbook_majority_undercovers_and_exact_fixes_it():
    n, k = 60, 10
    textbook = majority_miscoverage([textbook_rank(n, 0.1)] * k, [n] * k, 0.1)
    exact = majority_miscoverage([exact_rank(n, 0.1, k)] * k, [n] * k, 0.1)
    assert textbook > 0.11
    assert exact <= 0.1


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(20, 200),
    k=st.integers(1, 12),
    alpha=st.sampled_from([0.05, 0.1, 0.2]),
)
def test_exact_and_markov_ranks_bound_the_miscoverage(n, k, alpha):
    for mode in ("exact", "markov"):
        rank = part_rank(n, alpha, k, mode)
        if rank >= 1:
            assert majority_miscoverage([rank] * k, [n] * k, alpha) <= alpha + 1e-9
        assert rank <= textbook_rank(n, alpha)


def test_exact_mode_coverage_by_monte_carlo():
    rng = np.random.default_rng(0)
    n, k, alpha, trials = 40, 10, 0.1, 4000
    rank = exact_rank(n, alpha, k)
    tau = majority_threshold(k, alpha)
    cal = np.sort(rng.random((trials, k, n)), axis=2)[:, :, rank - 1]
    test = rng.random((trials, 1))
    covered = ((test >= cal).sum(axis=1) > tau).mean()
    assert covered >= 1 - alpha - 0.015
    textbook = np.sort(rng.random((trials, k, n)), axis=2)[
        :, :, textbook_rank(n, alpha) - 1
    ]
    assert ((test >= textbook).sum(axis=1) > tau).mean() < covered


def test_minimum_part_size():
    assert minimum_part_size(0.1, 1, "official") == 9
    assert part_rank(minimum_part_size(0.1, 10, "exact"), 0.1, 10, "exact") == 1
    assert part_rank(minimum_part_size(0.1, 10, "exact") - 1, 0.1, 10, "exact") == 0


@pytest.mark.parametrize("alpha", [0, 1, -0.1, 1.5, float("nan"), "0.1", True])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        majority_threshold(5, alpha)


def test_bad_parts_and_mode():
    with pytest.raises(ValueError, match="n_parts"):
        majority_threshold(0, 0.1)
    with pytest.raises(ValueError, match="quantile mode"):
        part_rank(10, 0.1, 2, "median")  # type: ignore[arg-type]
