import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from defense_suite.federated.accounting import UnreachableBudget
from defense_suite.federated.schedule import (
    StrictOnly,
    TimeAdaptive,
    Uniform,
    plan_schedules,
)

DELTA = 1e-5
BUDGETS = [1.0, 1.0, 3.0, 8.0]


def _plan(policy, budgets=BUDGETS, **kw):
    args = {"delta": DELTA, "rounds": 20, "steps": 4, "sigma": 1.0, **kw}
    return plan_schedules(budgets, policy, **args)


@pytest.mark.parametrize(
    "policy", [Uniform(), TimeAdaptive(0.5, 0.7), StrictOnly(0.3, 0.5)]
)
def test_every_client_spends_within_one_percent_below_its_budget(policy):
    for schedule in _plan(policy):
        spent = schedule.epsilon()
        assert 0.99 * schedule.budget <= spent <= schedule.budget


def test_time_adaptive_rates_bracket_the_uniform_rate():
    uniform = _plan(Uniform())
    adaptive = _plan(TimeAdaptive(0.5, 0.6))
    for u, a in zip(uniform, adaptive, strict=True):
        q_u = u.rates[0]
        assert a.rates[0] == pytest.approx(0.6 * q_u)
        assert a.rates[0] <= q_u <= a.rates[-1]
        assert a.rates[:10] == [a.rates[0]] * 10
        assert a.rates[10:] == [a.rates[-1]] * 10


@settings(max_examples=3, deadline=None)
@given(fraction=st.sampled_from([0.25, 0.5, 0.75]), ratio=st.floats(0.3, 1.0))
def test_per_round_spending_is_non_decreasing(fraction, ratio):
    for schedule in _plan(TimeAdaptive(fraction, ratio), budgets=[2.0, 6.0]):
        costs = schedule.round_costs()
        assert all(b >= a for a, b in itertools.pairwise(costs))
        assert schedule.epsilon() <= schedule.budget


def test_strict_only_saves_only_the_strictest_group():
    plans = _plan(StrictOnly(0.5, 0.5))
    for schedule in plans:
        saves = schedule.rates[0] < schedule.rates[-1]
        assert saves == (schedule.budget == min(BUDGETS))


def test_uniform_is_flat():
    for schedule in _plan(Uniform()):
        assert len(set(schedule.rates)) == 1


@pytest.mark.parametrize(
    ("budgets", "match"),
    [
        ([], "one epsilon per client"),
        ([1.0, 0.0], "budgets\\[1\\]"),
        ([-2.0], "budgets"),
    ],
)
def test_bad_budgets(budgets, match):
    with pytest.raises(ValueError, match=match):
        _plan(Uniform(), budgets=budgets)


def test_bad_delta_and_policy_parameters():
    with pytest.raises(ValueError, match="delta"):
        _plan(Uniform(), delta=1.0)
    with pytest.raises(ValueError, match="save_fraction"):
        TimeAdaptive(save_fraction=1.0)
    with pytest.raises(ValueError, match="save_ratio"):
        StrictOnly(save_ratio=0.0)
    with pytest.raises(ValueError, match="no saving or no spending round"):
        _plan(TimeAdaptive(0.01, 0.5), rounds=5)


def test_unmeetable_budget_fails_before_training():
    with pytest.raises(UnreachableBudget, match="cannot be spent"):
        _plan(Uniform(), budgets=[500.0], rounds=2, steps=1, sigma=3.0)
