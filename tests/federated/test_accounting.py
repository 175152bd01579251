import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from defense_suite.federated.accounting import (
    UnreachableBudget,
    epsilon,
    merge,
    solve_noise_multiplier,
    solve_spend_rate,
    solve_uniform_rate,
)

DELTA = 1e-5


def test_golden_rdp_and_prv_of_a_save_spend_history():
    # Research note, section 3.4: RDP 3.440, PRV 2.944 on this history.
    history = [(1.0, 0.0187, 60), (1.0, 0.0494, 60)]
    assert epsilon(history, DELTA, "rdp") == pytest.approx(3.440, abs=2e-3)
    assert epsilon(history, DELTA, "prv") == pytest.approx(2.944, abs=2e-2)


@pytest.mark.parametrize(
    ("budget", "save_rounds", "ratio", "q_unif", "q_spend"),
    [(2.0, 15, 0.5, 0.0152, 0.0187), (2.0, 21, 0.5, 0.0152, 0.0218)],
)
def test_golden_schedule_rates(budget, save_rounds, ratio, q_unif, q_spend):
    # Research note table: sigma=1, T=30 rounds, K=10 steps, delta=1e-5.
    qu = solve_uniform_rate(budget, DELTA, 1.0, 300)
    assert qu == pytest.approx(q_unif, rel=0.02)
    qs = solve_spend_rate(
        budget, DELTA, 1.0, ratio * qu, save_rounds * 10, (30 - save_rounds) * 10
    )
    assert qs == pytest.approx(q_spend, rel=0.02)
    spent = epsilon(
        [(1.0, ratio * qu, save_rounds * 10), (1.0, qs, 300 - save_rounds * 10)], DELTA
    )
    assert 0.995 * budget <= spent <= budget


def test_composition_merges_identical_phases():
    split = [(1.0, 0.02, 40), (1.0, 0.02, 80)]
    assert merge(split) == [(1.0, 0.02, 120)]
    assert epsilon(split, DELTA) == epsilon([(1.0, 0.02, 120)], DELTA)


def test_empty_history_spends_nothing():
    assert epsilon([], DELTA) == 0.0
    assert epsilon([(1.0, 0.0, 10)], DELTA) == 0.0


@settings(max_examples=4, deadline=None)
@given(
    q1=st.floats(0.005, 0.1),
    q2=st.floats(0.005, 0.1),
    k1=st.integers(1, 60),
    k2=st.integers(1, 60),
    sigma=st.floats(0.8, 2.0),
)
def test_prv_never_above_rdp(q1, q2, k1, k2, sigma):
    history = [(sigma, q1, k1), (sigma, q2, k2)]
    assert epsilon(history, DELTA, "prv") <= epsilon(history, DELTA, "rdp") + 0.05


@settings(max_examples=6, deadline=None)
@given(q=st.floats(0.001, 0.2), k=st.integers(1, 100), extra=st.integers(1, 50))
def test_epsilon_grows_with_steps_and_rate(q, k, extra):
    base = epsilon([(1.0, q, k)], DELTA)
    assert epsilon([(1.0, q, k + extra)], DELTA) >= base
    assert epsilon([(1.0, min(1.0, 1.5 * q), k)], DELTA) >= base


def test_uniform_rate_is_monotone_in_budget():
    rates = [solve_uniform_rate(b, DELTA, 1.0, 120) for b in (1.0, 2.0, 4.0, 8.0)]
    assert rates == sorted(rates)
    assert len(set(rates)) == 4


def test_noise_multiplier_hits_budget():
    sigma = solve_noise_multiplier(2.0, DELTA, 1.0, 20)
    assert 0.995 * 2.0 <= epsilon([(sigma, 1.0, 20)], DELTA) <= 2.0


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0, math.nan])
def test_bad_delta(delta):
    with pytest.raises(ValueError, match="delta"):
        epsilon([(1.0, 0.1, 1)], delta)


@pytest.mark.parametrize("budget", [0.0, -1.0, math.inf, math.nan])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="budget"):
        solve_uniform_rate(budget, DELTA, 1.0, 10)


def test_bad_accountant_and_history():
    with pytest.raises(ValueError, match="accountant"):
        epsilon([(1.0, 0.1, 1)], DELTA, "gdp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sigma"):
        epsilon([(0.0, 0.1, 1)], DELTA)
    with pytest.raises(ValueError, match="q must"):
        epsilon([(1.0, 1.5, 1)], DELTA)
    with pytest.raises(ValueError, match="steps"):
        epsilon([(1.0, 0.1, -2)], DELTA)


def test_unreachable_budgets_raise():
    with pytest.raises(UnreachableBudget, match="cannot be spent"):
        solve_uniform_rate(1000.0, DELTA, 5.0, 2)
    with pytest.raises(UnreachableBudget, match="already exceeded"):
        solve_spend_rate(1.0, DELTA, 1.0, 0.5, 100, 10)
