import dataclasses

import numpy as np
import pytest

from defenses.harness import run_once
from defenses.registry import available, create
from defenses.rps.arms import RPS, BaggingEnsemble, SplitConformalLearner
from defenses.rps.attacks import (
    CalibrationSize,
    PairFlip,
    RandomFlip,
    TargetedFlip,
    WorstCase,
)
from defenses.rps.scenario import ConformalPoisoning
from defenses.testing import check_pair
from tests.defenses.rps.attack_set import attack_set

TINY = ConformalPoisoning(dataset="wine", n_targets=20, confidence_level=0.8)
ATTACKS = attack_set(5, (0.3, 0.3, 0.2), (0, 1, 0.5), (3, 2))
DEFENSES = [RPS(n_train_parts=3, n_calib_parts=2), BaggingEnsemble(n_models=3)]


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
@pytest.mark.parametrize("defense", DEFENSES, ids=lambda d: d.name)
def test_check_pair(attack, defense):
    undefended, defended = check_pair(TINY, attack, defense)
    assert undefended.success["target_changed_rate"] >= 0.05
    assert defended.success["violations"] == 0.0


def test_registry_names():
    assert "rps-poisoning" in available("scenarios")
    assert {a.name for a in ATTACKS} <= set(available("attacks"))
    assert {"rps-reliable", "rps-bagging"} <= set(available("defenses"))
    assert {"rps-coverage", "rps-tradeoff", "rps-perf"} <= set(available("benchmarks"))
    assert "rps" in available("figures")
    assert create("defenses", "rps-reliable", {"n_train_parts": 4}).n_train_parts == 4


def test_certificate_metrics_and_clean_judge():
    result = run_once(TINY, TargetedFlip(flips=1), RPS(3, 2), seed=1)
    assert 0 <= result.certificate["robust_fraction@rt1"] <= 1
    assert result.certificate["miscoverage_bound"] <= 0.2
    assert result.utility["coverage"] >= 0.6


def test_wrap_does_not_mutate_and_rejects_foreign_learners():
    learner = SplitConformalLearner()
    before = dataclasses.asdict(learner)
    RPS().wrap(learner)
    assert dataclasses.asdict(learner) == before
    with pytest.raises(TypeError, match="SplitConformalLearner"):
        RPS().wrap(object())


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: ConformalPoisoning(dataset="mnist"), "dataset"),
        (lambda: ConformalPoisoning(confidence_level=1.0), "confidence_level"),
        (
            lambda: ConformalPoisoning(train_fraction=0.7, calib_fraction=0.3),
            "test split",
        ),
        (lambda: ConformalPoisoning(n_targets=0), "n_targets"),
        (lambda: RPS(n_train_parts=0), "n_train_parts"),
        (lambda: RPS(quantile="median"), "quantile"),
        (lambda: BaggingEnsemble(n_models=0), "n_models"),
        (lambda: RandomFlip(fraction=0.0), "fraction"),
        (lambda: PairFlip(source=1, target=1), "differ"),
        (lambda: TargetedFlip(flips=0), "flips"),
        (lambda: CalibrationSize(fraction=2.0), "fraction"),
        (lambda: WorstCase(n_train_parts=2, train_parts=3), "more parts"),
        (lambda: SplitConformalLearner(confidence_level=1.0), "confidence_level"),
    ],
)
def test_bad_parameters(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_pair_flip_checks_classes_at_poisoning_time():
    task = TINY.setup(np.random.default_rng(0))
    with pytest.raises(ValueError, match="must lie in"):
        PairFlip(source=0, target=7).poison(task, np.random.default_rng(0))


def test_targeted_flips_never_erase_a_class():
    """Breast cancer: 5 targets x 20 flips can exceed the ~95 malignant training
    points (the full spec's seed 1 failed: 'fit needs at least 2 classes')."""
    scenario = ConformalPoisoning(dataset="breast_cancer", n_targets=5)
    task = scenario.setup(np.random.default_rng(1))
    poisoned = TargetedFlip(flips=300).poison(task, np.random.default_rng(0))
    after = np.bincount(poisoned.train.y, minlength=2)
    assert after.min() == 1
    assert np.sum(poisoned.train.y != task.train.y) > 0
    result = run_once(scenario, TargetedFlip(flips=20), None, seed=1)
    assert result.success["target_changed_rate"] >= 0.2
