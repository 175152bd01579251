import numpy as np
import pytest

from defense_suite.federated.accounting import epsilon
from defense_suite.federated.audit import (
    canary_audit,
    likelihood_ratio,
    lower_bound,
    observe_canary,
)
from defense_suite.federated.benchmark import audit_controls
from defense_suite.federated.client import StepPlan
from defense_suite.federated.schedule import TimeAdaptive, plan_schedules


def test_controls_are_caught_and_correct_accountant_is_not():
    results = {r.defense: r for r in audit_controls({"trials": 4000}, [0])}
    assert results["none"].success["violation"] == 0.0
    assert results["none"].success["eps_lb"] > 1.0
    for control in ("wrong-rate", "no-saving-steps", "fixed-batches"):
        r = results[control]
        assert r.success["violation"] == 1.0, control
        assert r.success["eps_lb"] > r.certificate["eps_claimed"]


@pytest.mark.parametrize("seed", [0, 1])
def test_lower_bound_never_exceeds_accounted_epsilon_of_real_schedules(seed):
    delta = 1e-2
    schedules = plan_schedules(
        [1.0, 4.0], TimeAdaptive(0.5, 0.5), delta=1e-5, rounds=10, steps=4, sigma=1.0
    )
    for schedule in schedules:
        plans = [StepPlan(r.rate, r.steps, r.sigma) for r in schedule.rounds]
        claimed = epsilon(schedule.history(), delta)
        result = canary_audit(
            plans,
            claimed,
            delta=delta,
            n_records=50,
            trials=3000,
            rng=np.random.default_rng(seed),
        )
        assert not result.violated
        assert result.eps_lower_bound <= claimed


def test_non_private_client_is_exposed():
    plans = [StepPlan(0.5, 2, None)] * 3
    result = canary_audit(
        plans, 0.1, delta=1e-5, n_records=10, trials=2000, rng=np.random.default_rng(0)
    )
    assert result.eps_lower_bound > 4.0


def test_random_scores_give_no_bound():
    rng = np.random.default_rng(0)
    truth = rng.random(4000) < 0.5
    assert lower_bound(rng.random(4000), truth, 1e-5, rng) < 0.1


def test_observations_are_shifted_by_the_canary():
    rng = np.random.default_rng(0)
    flags = np.array([True] * 3000 + [False] * 3000)
    obs = observe_canary([StepPlan(1.0, 1, 0.5)], flags, 5, "poisson", rng)
    assert obs[:3000].mean() == pytest.approx(1.0, abs=0.05)
    assert obs[3000:].mean() == pytest.approx(0.0, abs=0.05)
    assert obs[3000:].std() == pytest.approx(0.5, rel=0.05)


def test_bad_audit_inputs():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="trials"):
        canary_audit(
            [StepPlan(0.5, 1, 1.0)], 1.0, delta=1e-5, n_records=5, trials=5, rng=rng
        )
    with pytest.raises(ValueError, match="no rounds"):
        observe_canary([], np.array([True, False]), 5, "poisson", rng)
    with pytest.raises(ValueError, match="do not match"):
        likelihood_ratio(np.zeros((3, 2)), [0.1], [1.0])
    with pytest.raises(ValueError, match="finite"):
        lower_bound(np.array([np.nan] * 4), np.array([True, False] * 2), 1e-5, rng)
