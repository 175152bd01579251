"""The bad-input rule on the federated package's public entry points."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from defense_suite.federated.accounting import (
    epsilon,
    solve_noise_multiplier,
    solve_spend_rate,
    solve_uniform_rate,
)
from defense_suite.federated.arms import IDPFedAvg, TimeAdaptiveDP
from defense_suite.federated.client import LocalData, StepPlan, local_train
from defense_suite.federated.flower.config import AppConfig
from defense_suite.federated.ledger import ClientPrivacy, PrivacyLedger
from defense_suite.federated.partition import dirichlet_split
from defense_suite.federated.schedule import (
    TimeAdaptive,
    Uniform,
    plan_client,
    plan_schedules,
)
from defenses.testing import (
    EXTREME_REALS,
    VALID_NUMPY_SCALARS,
    WRONG_TYPES,
    assert_rule,
    bad_arrays,
    bad_reals,
    rule_settings,
)

RNG = np.random.default_rng(0)
DATA = LocalData(RNG.normal(size=(30, 4)), RNG.integers(0, 3, 30), 3)
PARAMS = [np.zeros((4, 3)), np.zeros(3)]
PRIVACY = ClientPrivacy(epsilon=2.0, delta=1e-5, rounds=2, steps=2, sigma=1.0)
EDGES = st.sampled_from(EXTREME_REALS + WRONG_TYPES + VALID_NUMPY_SCALARS)
"""The shared edge values alone, for entry points that solve a schedule (a random
valid real costs a full calibration, seconds each)."""


def _finite_params(params):
    assert len(params) == 2
    assert params[0].shape == (4, 3)


def test_plan_schedules_without_a_policy_names_it():
    for policy in (None, "time-adaptive", 3):
        assert_rule(
            lambda p=policy: plan_schedules(
                [1.0], p, delta=1e-5, rounds=4, steps=2, sigma=1.0
            ),
            ["policy"],
        )
    with pytest.raises(TypeError, match="policy"):
        plan_schedules([1.0], None, delta=1e-5, rounds=4, steps=2, sigma=1.0)


@rule_settings(max_examples=8)
@given(EDGES, st.sampled_from(["budget", "delta", "sigma"]))
def test_solvers(value, which):
    args = {"budget": 2.0, "delta": 1e-5, "sigma": 1.0}
    args[which] = value
    assert_rule(
        lambda: solve_uniform_rate(args["budget"], args["delta"], args["sigma"], 8),
        [which],
        lambda q: 0.0 < q <= 1.0,
    )


@rule_settings(max_examples=6)
@given(EDGES)
def test_spend_rate_and_noise_multiplier(value):
    assert_rule(
        lambda: solve_spend_rate(2.0, 1e-5, 1.0, value, 4, 4), ["save_rate", "q"]
    )
    assert_rule(lambda: solve_noise_multiplier(2.0, 1e-5, value, 8), ["rate"])
    assert_rule(lambda: solve_uniform_rate(2.0, 1e-5, 1.0, value), ["steps"])


@rule_settings(max_examples=12)
@given(bad_reals(), st.integers(0, 2))
def test_epsilon_of_a_history(value, slot):
    phase = [1.0, 0.1, 4]
    phase[slot] = value
    assert_rule(
        lambda: epsilon([tuple(phase)], 1e-5),
        ["sigma", "q", "steps", "history"],
        lambda e: e >= 0.0,
    )
    assert_rule(lambda: epsilon([(1.0, 0.1, 4)], value), ["delta"])


@rule_settings(max_examples=6)
@given(EDGES, st.sampled_from(["budget", "sigma", "save_ratio"]))
def test_plan_client(value, which):
    args = {"budget": 2.0, "sigma": 1.0, "save_ratio": 0.7}
    args[which] = value
    assert_rule(
        lambda: plan_client(
            args["budget"], delta=1e-5, rounds=4, steps=2, sigma=args["sigma"],
            save_rounds=2, save_ratio=args["save_ratio"],
        ),
        [which],
    )  # fmt: skip


@rule_settings(max_examples=20)
@given(bad_reals(), st.sampled_from(["save_fraction", "save_ratio"]))
def test_policies(value, which):
    assert_rule(lambda: TimeAdaptive(**{which: value}), [which])
    assert_rule(lambda: TimeAdaptiveDP(**{which: value}), [which])
    assert_rule(lambda: IDPFedAvg(sigma=value), ["sigma"])


@rule_settings(max_examples=20)
@given(bad_arrays((30, 4)))
def test_local_data_and_training(features):
    assert_rule(
        lambda: local_train(
            PARAMS,
            LocalData(features, DATA.y[: len(features)], 3),
            StepPlan(0.5, 2, 1.0),
            lr=0.5,
            clip=1.0,
            rng=np.random.default_rng(0),
        ),
        ["X", "features", "client data", "labels"],
        _finite_params,
    )


@rule_settings(max_examples=20)
@given(bad_reals(), st.sampled_from(["rate", "sigma", "lr", "clip"]))
def test_step_plan_and_local_train(value, which):
    plan = {"rate": 0.5, "sigma": 1.0}
    hyper = {"lr": 0.5, "clip": 1.0}
    (plan if which in plan else hyper)[which] = value
    assert_rule(
        lambda: local_train(
            PARAMS, DATA, StepPlan(plan["rate"], 2, plan["sigma"]),
            rng=np.random.default_rng(0), **hyper,
        ),
        [which],
        _finite_params,
    )  # fmt: skip


@rule_settings(max_examples=20)
@given(bad_reals(), st.sampled_from(["n_clients", "alpha"]))
def test_dirichlet_split(value, which):
    args = {"n_clients": 3, "alpha": 0.5}
    args[which] = value
    assert_rule(
        lambda: dirichlet_split(DATA.y, rng=np.random.default_rng(0), **args),
        [which],
        lambda parts: len(parts) == args["n_clients"],
    )


@rule_settings(max_examples=15)
@given(bad_reals(), st.sampled_from(["server-round", "rate", "sigma", "steps"]))
@example(75065545, "sigma")  # Opacus's RDP analysis fails there (a local run found it)
def test_the_ledger_refuses_or_grants(value, which):
    own = PRIVACY.schedule().rounds[0]
    request = {"server-round": 1, "rate": own.rate, "sigma": own.sigma,
               "steps": own.steps}  # fmt: skip
    request[which] = value
    assert_rule(
        lambda: PrivacyLedger(PRIVACY).check(*request.values()),
        [which],
        lambda grant: grant.rate <= own.rate and grant.sigma >= own.sigma,
    )


@rule_settings(max_examples=20)
@given(
    bad_reals(),
    st.sampled_from(["epsilon", "delta", "rounds", "steps", "sigma", "save_ratio"]),
)
def test_client_privacy(value, which):
    args = {"epsilon": 2.0, "delta": 1e-5, "rounds": 2, "steps": 2, "sigma": 1.0}
    args[which] = value
    assert_rule(lambda: ClientPrivacy(**args), [which])


@rule_settings(max_examples=30)
@given(
    st.one_of(bad_reals(), st.text(max_size=5), st.booleans()),
    st.sampled_from(
        ["num-server-rounds", "sigma", "delta", "budgets", "model", "dp-wrapper",
         "seed", "save-ratio", "n-clients"]
    ),
)  # fmt: skip
@example("1", "budgets")  # one budget, three default fractions: names 'budgets'
@example("0.5,0.5", "budgets")
def test_app_config(value, key):
    assert_rule(lambda: AppConfig.from_mapping({key: value}), [key])


@pytest.mark.parametrize("budgets", ["1", "1,2", "1,2,3,4"])
def test_a_budget_list_of_another_length_names_both_keys(budgets):
    with pytest.raises(ValueError, match="one entry per budget") as info:
        AppConfig.from_mapping({"budgets": budgets})
    assert "budgets (" in str(info.value)
    assert str(info.value).startswith("group-fractions ")


def test_numpy_scalars_are_accepted():
    assert plan_schedules(
        [np.float32(2.0)], Uniform(), delta=np.float64(1e-5), rounds=np.int64(2),
        steps=np.int32(2), sigma=np.float32(1.0),
    )  # fmt: skip
    ClientPrivacy(np.float64(2.0), np.float32(1e-5), np.int64(2), np.int8(2), 1.0)
    assert epsilon([(np.float32(1.0), np.float64(0.1), np.int64(4))], 1e-5) > 0
