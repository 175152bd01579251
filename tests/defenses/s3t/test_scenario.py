from __future__ import annotations

import numpy as np
import pytest

from defenses import registry
from defenses.harness import run_once
from defenses.s3t.arms import FullRetrainDefense, NoUnlearning, S3TDefense, SISADefense
from defenses.s3t.attacks import CanaryAttack
from defenses.s3t.scenario import CanaryDeletion
from defenses.testing import check_pair

TINY = {
    "canaries": 8,
    "repeats": 4,
    "pool": 150,
    "public": 120,
    "width": 24,
    "hidden": 32,
    "blocks": 4,
    "pretrain_epochs": 5,
    "rank": 4,
    "epochs": 12,
}


@pytest.mark.parametrize(
    "defense",
    [S3TDefense(2, 2), SISADefense(2, 2), FullRetrainDefense()],
    ids=["s3t", "sisa", "full-retrain"],
)
def test_check_pair(defense) -> None:
    undefended, defended = check_pair(CanaryDeletion(**TINY), CanaryAttack(), defense)
    assert undefended.success["auc"] > 0.7
    assert defended.success["auc"] < undefended.success["auc"]
    assert defended.certificate["exact"] == 1.0
    assert undefended.success["flip_gap"] > defended.success["flip_gap"]


def test_everything_is_registered() -> None:
    # Reads the registry directly: discover() would import every other package too.
    known = registry._registry
    assert known["scenarios"]["s3t-canary-deletion"] is CanaryDeletion
    assert known["attacks"]["s3t-canary-mia"] is CanaryAttack
    assert known["defenses"]["s3t-s3t"] is S3TDefense
    assert known["defenses"]["s3t-sisa"] is SISADefense
    assert known["defenses"]["s3t-full-retrain"] is FullRetrainDefense
    assert callable(known["benchmarks"]["s3t-deletion"])
    assert callable(known["figures"]["s3t"])


def test_blind_guess_is_exactly_chance() -> None:
    scenario = CanaryDeletion(**TINY)
    task = scenario.setup(np.random.default_rng(0))
    guess = scenario.random_guess(task, np.random.default_rng(0))
    system = scenario.learner().fit(task, np.random.default_rng(0))
    assert scenario.judge(system, task, guess)["auc"] == 0.5
    assert task.was_trained.sum() == TINY["canaries"]
    assert task.forget.size == TINY["canaries"] * TINY["repeats"]
    assert np.all(np.isin(task.forget, task.ids))


def test_s3t_serves_without_retraining_one_users_deletion() -> None:
    result = run_once(CanaryDeletion(**TINY), CanaryAttack(), S3TDefense(2, 2), 1)
    assert result.cost.get("retrain_s", 0.0) == 0.0
    assert result.cost["unlearn_s"] > 0.0
    assert 0 < result.certificate["served_depth"] < 1


def test_wrap_needs_the_scenario_learner() -> None:
    with pytest.raises(TypeError, match="NoUnlearning"):
        S3TDefense().wrap(object())  # type: ignore[arg-type]
    base = NoUnlearning()
    wrapped = S3TDefense().wrap(base)
    assert wrapped.base is base


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: CanaryDeletion(canaries=1), r"canaries must be an int in \[2, 100\]"),
        (lambda: CanaryDeletion(pool=-1), "pool must be"),
        (lambda: CanaryDeletion(epochs=0), "epochs must be an int >= 1"),
        (lambda: CanaryDeletion(lr=0.0), r"lr must be a finite number in \(0.0, 1.0\)"),
        (lambda: CanaryDeletion(width=0), "CanaryDeletion.width must be an int >= 1"),
        (lambda: CanaryDeletion(public=0), "CanaryDeletion.public must be an int"),
        (lambda: CanaryDeletion(pretrain_epochs=0), "CanaryDeletion.pretrain_epochs"),
        (lambda: CanaryDeletion(model="cnn"), "CanaryDeletion.model must be one of"),  # type: ignore[arg-type]
        (lambda: SISADefense(retrain="never"), "SISADefense.retrain must be"),  # type: ignore[arg-type]
        (lambda: S3TDefense(shards=0), "shards must be an int >= 1"),
        (lambda: S3TDefense(sequences=0), "sequences must be an int >= 1"),
        (lambda: S3TDefense(selection="x"), "selection must be"),  # type: ignore[arg-type]
        (lambda: S3TDefense(retrain="never"), "retrain must be"),  # type: ignore[arg-type]
        (lambda: SISADefense(slices=0), "slices must be an int >= 1"),
    ],
)
def test_bad_parameters(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_pool_larger_than_available_is_an_error() -> None:
    scenario = CanaryDeletion(**{**TINY, "pool": 5000})
    with pytest.raises(ValueError, match="exceeds"):
        scenario.setup(np.random.default_rng(0))
