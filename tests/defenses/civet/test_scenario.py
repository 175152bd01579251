from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from defenses.civet.arms import CivetTraining, PGDTraining
from defenses.civet.attacks import EOTPGD, JointPGD, LatentAttack, MaxDamage, VAEGuess
from defenses.registry import available, create
from defenses.results import Result
from defenses.testing import check_pair
from tests.defenses.civet.helpers import TINY

ATTACKS: list[Any] = [
    JointPGD(steps=10, restarts=1),
    EOTPGD(steps=10, samples=2),
    LatentAttack(steps=10),
    MaxDamage(steps=10),
]
DEFENSES: list[Any] = [CivetTraining(), PGDTraining(steps=2)]

# Every attack is checked against CIVET training and every defense against the joint
# attack in the fast tier; the rest of the cross product (the contract does not
# couple a defense's training to a particular attack) runs with --runslow.
PAIRS = [
    pytest.param(
        defense,
        attack,
        id=f"{defense.name}-{attack.name}",
        marks=[] if i == 0 or j == 0 else [pytest.mark.slow],
    )
    for i, defense in enumerate(DEFENSES)
    for j, attack in enumerate(ATTACKS)
]

_PAIRS: dict[tuple[str, str], tuple[Result, Result]] = {}


def _checked_pair(attack: Any, defense: Any) -> tuple[Result, Result]:
    """``check_pair(TINY, attack, defense)``, run once per module for each pair."""
    key = (repr(attack), repr(defense))
    if key not in _PAIRS:
        _PAIRS[key] = check_pair(TINY, attack, defense)
    return _PAIRS[key]


@pytest.mark.parametrize(("defense", "attack"), PAIRS)
def test_check_pair(attack: Any, defense: Any) -> None:
    undefended, defended = _checked_pair(attack, defense)
    assert undefended.success["violation_rate"] == 0.0
    assert defended.success["violation_rate"] == 0.0
    assert defended.certificate["bound"] == pytest.approx(
        defended.utility["certified_loss"]
    )


def test_civet_arm_certifies_tighter_than_the_undefended_arm() -> None:
    undefended, defended = _checked_pair(ATTACKS[0], CivetTraining())
    assert defended.utility["certified_loss"] < undefended.utility["certified_loss"]
    assert defended.success["damage"] < undefended.success["damage"]
    # the trained arm's epoch over standard's, measured alternated in its own run
    assert defended.cost["epoch_ratio"] > 0
    assert defended.cost["epoch_ratio_cpu"] > 0
    assert "epoch_ratio" not in undefended.cost


def test_everything_is_registered_under_the_prefix() -> None:
    assert "civet-vae" in available("scenarios")
    for name in (
        "civet-joint-pgd",
        "civet-eot-pgd",
        "civet-latent",
        "civet-max-damage",
    ):
        assert name in available("attacks")
    assert {"civet-train", "civet-pgd-train"} <= set(available("defenses"))
    assert "civet-eps" in available("benchmarks")
    assert "civet" in available("figures")
    scenario = create("scenarios", "civet-vae", {"eps": 0.05, "hidden": [16, 8]})
    assert scenario.hidden == (16, 8)


def test_wrap_keeps_the_learner_and_changes_the_method() -> None:
    learner = TINY.learner()
    wrapped = CivetTraining(eps=0.05, kappa=0.3).wrap(learner)
    assert learner.method == "standard"
    assert wrapped.method == "civet"
    assert wrapped.config.eps == 0.05
    assert wrapped.config.kappa == 0.3
    assert PGDTraining().wrap(learner).method == "pgd"
    assert PGDTraining().wrap(learner).config.eps == TINY.eps
    with pytest.raises(TypeError, match="needs a VAELearner"):
        CivetTraining().wrap(object())  # type: ignore[arg-type]


def test_judge_refuses_inadmissible_guesses() -> None:
    rng = np.random.default_rng(0)
    task = TINY.setup(rng)
    system = TINY.learner().fit(task, rng)
    with pytest.raises(ValueError, match="moves"):
        TINY.judge(system, task, VAEGuess(np.clip(task.x_eval + 0.5, 0, 1)))
    nu = np.full((task.x_eval.shape[0], 2), 10.0)
    with pytest.raises(ValueError, match="noise box"):
        TINY.judge(system, task, VAEGuess(task.x_eval, nu))
    with pytest.raises(ValueError, match="shape"):
        TINY.judge(system, task, VAEGuess(task.x_eval[:3]))
    with pytest.raises(ValueError, match="needs a guess"):
        TINY.judge(system, task, None)


def test_null_guess_scores_exactly_chance() -> None:
    rng = np.random.default_rng(0)
    task = TINY.setup(rng)
    system = TINY.learner().fit(task, rng)
    scores = TINY.judge(system, task, TINY.random_guess(task, rng))
    assert scores["damage"] == 0.0
    assert scores["attack_loss"] == pytest.approx(
        TINY.utility(system, task)["clean_loss"], rel=0.3
    )


def test_conv_architecture_trains_and_certifies() -> None:
    scenario = dataclasses.replace(TINY, arch="conv", epochs=2)
    rng = np.random.default_rng(0)
    task = scenario.setup(rng)
    system = CivetTraining().wrap(scenario.learner()).fit(task, rng)
    utility = scenario.utility(system, task)
    assert 0 < utility["certified_loss"] <= 64
    assert utility["clean_loss"] <= utility["certified_loss"]
