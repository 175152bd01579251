from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from defenses.s3t.sequences import (
    bms_orders,
    cyclic_orders,
    deletion_rate_theory,
    harmonic,
    prefix_score,
    simulate_deletion_rate,
)


def test_cyclic_golden_vectors_from_the_note() -> None:
    assert cyclic_orders(4, 2) == [(0, 1, 2, 3), (3, 0, 1, 2)]
    assert cyclic_orders(4, 4) == [
        (0, 1, 2, 3),
        (3, 0, 1, 2),
        (2, 3, 0, 1),
        (1, 2, 3, 0),
    ]
    official_b8 = {
        (0, 1, 2, 3),
        (0, 3, 1, 2),
        (3, 0, 1, 2),
        (3, 2, 0, 1),
        (2, 3, 0, 1),
        (2, 1, 3, 0),
        (1, 2, 3, 0),
        (1, 0, 2, 3),
    }
    assert set(cyclic_orders(4, 8)) == official_b8


@given(st.integers(1, 6))
def test_cyclic_first_l_orders_form_a_latin_square(slices: int) -> None:
    orders = np.array(cyclic_orders(slices, slices))
    for position in range(slices):
        assert sorted(orders[:, position]) == list(range(slices))


@given(st.integers(1, 5), st.data())
def test_cyclic_orders_are_distinct_permutations_with_min_b_l_first_slices(
    slices: int, data: st.DataObject
) -> None:
    budget = data.draw(st.integers(1, math.factorial(slices)))
    orders = cyclic_orders(slices, budget)
    assert len(set(orders)) == budget
    assert all(sorted(o) == list(range(slices)) for o in orders)
    assert len({o[0] for o in orders}) == min(budget, slices)


def test_bms_puts_likely_deleted_slices_late() -> None:
    orders = bms_orders([0.4, 0.3, 0.2, 0.1], 2)
    # the two least likely slices lead; the tail order of slices 0 and 1 is a tie
    assert [o[:2] for o in orders] == [(3, 2), (2, 3)]
    assert all(sorted(o[2:]) == [0, 1] for o in orders)
    assert {o[0] for o in orders} == {3, 2}
    for order in orders:
        assert order.index(0) >= 2


@given(
    st.lists(st.floats(0.01, 1.0), min_size=2, max_size=6),
    st.data(),
)
@settings(max_examples=30, deadline=None)
def test_bms_orders_are_permutations_and_first_slices_are_least_likely(
    probs: list[float], data: st.DataObject
) -> None:
    budget = data.draw(st.integers(1, len(probs)))
    orders = bms_orders(probs, budget)
    assert all(sorted(o) == list(range(len(probs))) for o in orders)
    firsts = [o[0] for o in orders]
    assert len(set(firsts)) == budget
    chosen = sorted(probs[j] for j in firsts)
    assert chosen == pytest.approx(sorted(probs)[:budget])


def test_prefix_score_is_expected_surviving_length() -> None:
    p = np.array([0.5, 0.5])
    assert prefix_score([0, 1], p, 1.0) == pytest.approx(0.5)
    assert prefix_score([0], p, 2.0) == pytest.approx(0.25)


def test_theory_golden_values_from_the_note() -> None:
    assert harmonic(3) == pytest.approx(11 / 6)
    expected = {1: 68.5, 2: 87.9, 3: 99.5, 4: 107.9, 5: 114.5, 6: 119.8}
    for budget, value in expected.items():
        assert deletion_rate_theory(5, 6, budget) == pytest.approx(value, abs=0.1)
    assert deletion_rate_theory(5, 6, 720) == deletion_rate_theory(5, 6, 6)
    gains = {(5, 4): 1.58, (3, 6): 1.91, (10, 5): 1.54}
    for (m, length), gain in gains.items():
        ratio = deletion_rate_theory(m, length, length) / deletion_rate_theory(
            m, length, 1
        )
        assert ratio == pytest.approx(gain, abs=0.01)


@pytest.mark.parametrize(
    ("shards", "slices", "budget"), [(3, 3, 1), (3, 3, 3), (2, 4, 2)]
)
def test_monte_carlo_matches_theory_within_three_standard_errors(
    shards: int, slices: int, budget: int
) -> None:
    rng = np.random.default_rng(0)
    all_dead, first_dead = simulate_deletion_rate(
        shards, cyclic_orders(slices, budget), rng, runs=3000
    )
    theory = deletion_rate_theory(shards, slices, budget)
    error = all_dead.std(ddof=1) / math.sqrt(all_dead.size)
    assert abs(all_dead.mean() - theory) < 3 * error
    assert np.all(first_dead <= all_dead)


def test_skewed_prior_and_bms_outlive_cyclic_when_budget_is_small() -> None:
    prior = np.array([0.05, 0.05, 0.1, 0.8])
    rng = np.random.default_rng(1)
    cyclic, _ = simulate_deletion_rate(3, cyclic_orders(4, 1), rng, 2000, prior[::-1])
    bms, _ = simulate_deletion_rate(
        3, bms_orders(prior[::-1], 1), rng, 2000, prior[::-1]
    )
    assert bms.mean() > 2 * cyclic.mean()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: cyclic_orders(3, 7), "exceeds the 6 orders"),
        (lambda: cyclic_orders(0, 1), "slices must be an int >= 1"),
        (lambda: cyclic_orders(3, 0), "sequences must be an int >= 1"),
        (lambda: bms_orders([0.5, 0.5], 3), "at most slices=2"),
        (lambda: bms_orders([0.5, -0.1], 1), "finite values >= 0"),
        (lambda: bms_orders([0.0, 0.0], 1), "must not all be zero"),
        (lambda: bms_orders([0.5, 0.5], 1, horizon=0.0), "horizon must be > 0"),
        (lambda: deletion_rate_theory(0, 3, 1), "shards must be an int >= 1"),
        (lambda: simulate_deletion_rate(2, [], np.random.default_rng(0)), "empty"),
        (
            lambda: simulate_deletion_rate(
                2, [(0, 1)], np.random.default_rng(0), slice_probs=[0.2, 0.2]
            ),
            "summing to 1",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
