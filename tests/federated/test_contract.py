import numpy as np
import pytest

from defense_suite.federated.arms import (
    DPFedAvg,
    FlowerCentralDP,
    IDPFedAvg,
    TimeAdaptiveDP,
)
from defense_suite.federated.attacks import CanaryObserver, GlobalModelMIA
from defense_suite.federated.scenario import FederatedAudit, FederatedMembership
from defenses.harness import run_once
from defenses.registry import available, create
from defenses.testing import check_pair

TINY = {
    "n_clients": 4,
    "rounds": 6,
    "local_steps": 20,
    "batch_rate": 1.0,
    "member_fraction": 0.1,
    "lr": 2.0,
}
DEFENSES = [TimeAdaptiveDP(), IDPFedAvg(), DPFedAvg(), FlowerCentralDP()]


@pytest.mark.parametrize("defense", DEFENSES, ids=lambda d: d.name)
def test_check_pair_membership(defense):
    undefended, defended = check_pair(
        FederatedMembership(**TINY), GlobalModelMIA(), defense
    )
    assert undefended.success["auc"] > 0.55
    assert {"auc_strict", "auc_moderate", "auc_relaxed"} <= set(defended.success)
    assert defended.certificate["spent_ratio_max"] <= 1.0


@pytest.mark.parametrize("defense", DEFENSES, ids=lambda d: d.name)
def test_check_pair_audit(defense):
    scenario = FederatedAudit(**TINY, audit_trials=600)
    undefended, defended = check_pair(scenario, CanaryObserver(), defense)
    assert undefended.success["eps_lb"] > 2.0
    if defense.name == "federated-flower-dp":
        # Central DP: the server still sees each client's raw update.
        assert defended.success["eps_lb"] > 2.0
    else:
        assert defended.success["eps_lb"] <= defended.certificate["eps_strict"]


def test_every_component_is_registered_under_the_package_prefix():
    for kind in ("scenarios", "attacks", "defenses", "benchmarks"):
        ours = [n for n in available(kind) if n.startswith("federated")]
        assert ours, kind
    assert "federated" in available("figures")
    scenario = create(
        "scenarios",
        "federated-membership",
        {"budgets": [2.0, 4.0], "group_fractions": [0.5, 0.5]},
    )
    assert scenario.budgets == (2.0, 4.0)
    assert hash(scenario) == hash(
        create(
            "scenarios",
            "federated-membership",
            {"budgets": (2.0, 4.0), "group_fractions": (0.5, 0.5)},
        )
    )


def test_realised_epsilon_within_one_percent_of_budget_per_client():
    scenario = FederatedMembership(**TINY)
    result = run_once(scenario, GlobalModelMIA(), TimeAdaptiveDP(save_ratio=0.5), 1)
    assert result.certificate["spent_ratio_min"] >= 0.99
    assert result.certificate["spent_ratio_max"] <= 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"budgets": [0.0, 1.0, 2.0]}, "budgets\\[0\\]"),
        ({"delta": 1.5}, "delta"),
        ({"delta": 0.0}, "delta"),
        ({"group_fractions": [0.5, 0.5]}, "group_fractions"),
        ({"dataset": "mnist"}, "dataset"),
        ({"n_clients": 1}, "n_clients"),
        ({"rounds": 0}, "rounds"),
        ({"model": "cnn"}, "model"),
    ],
)
def test_bad_scenario_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FederatedMembership(**kwargs)


def test_bad_defense_parameters():
    with pytest.raises(ValueError, match="sigma"):
        TimeAdaptiveDP(sigma=0.0)
    with pytest.raises(ValueError, match="save_ratio"):
        TimeAdaptiveDP(save_ratio=1.5)
    with pytest.raises(ValueError, match="accountant"):
        IDPFedAvg(accountant="gdp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clipping_norm"):
        FlowerCentralDP(clipping_norm=-1.0)


def test_unreachable_budget_fails_before_training():
    scenario = FederatedMembership(**{**TINY, "budgets": [1e4, 2e4, 3e4], "rounds": 2})
    learner = TimeAdaptiveDP(sigma=3.0, save_fraction=0.5).wrap(scenario.learner())
    task = scenario.setup(np.random.default_rng(0))
    with pytest.raises(ValueError, match="cannot be spent"):
        learner.fit(task, np.random.default_rng(0))
