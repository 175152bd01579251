"""Every hyper-parameter class of CIVET rejects a bad value, naming the field.

One table over the frozen dataclasses a user or a spec constructs: the scenario,
the training configuration, the learner, the training defenses and the attacks.
Each row builds the class with one bad keyword and expects a ValueError whose
message names the field (and, where it says so, what is allowed).
"""

from __future__ import annotations

from typing import Any

import pytest

from defenses.civet.arms import CivetTraining, PGDTraining, VAELearner
from defenses.civet.attacks import EOTPGD, JointPGD, LatentAttack, MaxDamage
from defenses.civet.defense import TrainConfig
from defenses.civet.scenario import CivetScenario

CASES: list[tuple[type[Any], dict[str, object], str]] = [
    (CivetScenario, {"data": "mnist"}, "data must be one of"),
    (CivetScenario, {"arch": "resnet"}, "arch must be one of"),
    (CivetScenario, {"arch": "conv", "data": "blobs"}, "needs data='digits'"),
    (CivetScenario, {"eps": -0.1}, r"eps must be a finite number in \[0\.0, 1\.0\]"),
    (CivetScenario, {"p": 1.0}, r"p must be a finite number in \(0\.0, 1\.0\)"),
    (CivetScenario, {"n_eval": 0}, "n_eval must be an int >= 1"),
    (CivetScenario, {"epochs": 0}, "epochs must be an int >= 1"),
    (CivetScenario, {"train_fraction": 1.0}, "train_fraction"),
    (TrainConfig, {"epochs": 0}, "epochs must be an int >= 1"),
    (TrainConfig, {"batch_size": 1.5}, "batch_size must be an int >= 1"),
    (TrainConfig, {"lr": 0.0}, "lr must be a finite number"),
    (TrainConfig, {"kappa": 1.5}, "kappa must be a finite number"),
    (TrainConfig, {"eps": -0.1}, "eps must be a finite number"),
    (TrainConfig, {"beta": float("nan")}, "beta must be a finite number"),
    (TrainConfig, {"ramp": 0.0}, "ramp must be a finite number"),
    (TrainConfig, {"warmup": -1}, "warmup must be an int >= 0"),
    (TrainConfig, {"levels": (0.9, 0.5)}, "increasing"),
    (TrainConfig, {"threads": 0}, "threads must be an int >= 1"),
    (VAELearner, {"arch": "rnn"}, "VAELearner.arch"),
    (CivetTraining, {"kappa": 2.0}, "CivetTraining.kappa must be a finite number in"),
    (CivetTraining, {"eps": -1.0}, "CivetTraining.eps"),
    (CivetTraining, {"levels": (0.9, 0.2)}, "CivetTraining.levels"),
    (PGDTraining, {"steps": 0}, "PGDTraining.steps must be an int >= 1"),
    (PGDTraining, {"kappa": -0.5}, "PGDTraining.kappa"),
    (JointPGD, {"steps": 0}, "JointPGD.steps must be an int >= 1"),
    (JointPGD, {"restarts": 0}, "JointPGD.restarts"),
    (EOTPGD, {"samples": 0}, "EOTPGD.samples"),
    (LatentAttack, {"steps": -1}, "LatentAttack.steps"),
    (MaxDamage, {"threads": 0}, "MaxDamage.threads"),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    CASES,
    ids=[f"{cls.__name__}-{'-'.join(kwargs)}" for cls, kwargs, _ in CASES],
)
def test_a_bad_hyper_parameter_is_refused_by_name(
    cls: type[Any], kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("cls", sorted({c for c, _, _ in CASES}, key=str))
def test_the_defaults_are_valid(cls: type[Any]) -> None:
    assert cls() is not None
