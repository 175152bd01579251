"""The inversion game: check_pair on every (attack, defense) pair, judge, knobs."""

from __future__ import annotations

import numpy as np
import pytest

from defenses.harness import run_once
from defenses.ssd.arms import SSDDefense
from defenses.ssd.attacks import (
    BoundaryRepulsion,
    GeneticInversion,
    InversionView,
    VotingBoundaryRepulsion,
)
from defenses.ssd.baselines import (
    ARTClassLabels,
    ARTGaussianNoise,
    ARTHighConfidence,
    ARTReverseSigmoid,
    ARTRounded,
    SSDConstantBudget,
    SSDNoTemperature,
)
from defenses.ssd.scenario import DigitsInversion, IdentitiesInversion
from defenses.testing import check_pair

TINY = DigitsInversion(n_targets=5, per_target=10)
ATTACKS = [
    BoundaryRepulsion(n_init=128, n_dirs=8, iterations=4),
    GeneticInversion(n_init=64, population=8, generations=3, elite=2),
    VotingBoundaryRepulsion(n_init=128, n_dirs=8, iterations=3, repeats=3),
]
DEFENSES = [
    SSDDefense(epsilon=1.0),
    SSDDefense(epsilon=1.0, seeding="input-hash", hash_resolution=0.01),
    SSDNoTemperature(),
    SSDConstantBudget(),
    ARTReverseSigmoid(),
    ARTGaussianNoise(),
    ARTRounded(),
    ARTHighConfidence(),
    ARTClassLabels(),
]


def test_the_pair_matrix_covers_every_attack_and_defense_the_package_registers():
    from defenses.registry import available, load
    from defenses.ssd import attacks, baselines

    assert {type(a) for a in ATTACKS} == set(attacks.ATTACKS)
    assert {type(d) for d in DEFENSES} == {SSDDefense, *baselines.BASELINES}
    for kind, classes in (("attacks", ATTACKS), ("defenses", DEFENSES)):
        ssd = {name for name in available(kind) if name.startswith("ssd-")}
        assert ssd == {c.name for c in classes}
        assert all(type(c) is load(kind, c.name) for c in classes)


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
@pytest.mark.parametrize("defense", DEFENSES, ids=lambda d: repr(d))
def test_check_pair(attack, defense):
    undefended, defended = check_pair(TINY, attack, defense)
    assert undefended.success["acc@1"] >= 0.5
    assert set(defended.utility) == {
        "accuracy",
        "l1_distortion",
        "test_flip_rate",
        "public_flip_rate",
    }
    assert defended.cost["queries"] == undefended.cost["queries"]


@pytest.mark.slow
def test_ssd_lowers_label_only_attack_on_identities():
    scenario = IdentitiesInversion(n_targets=10, per_target=2)
    attack = BoundaryRepulsion(iterations=15)
    none = run_once(scenario, attack, None, 0)
    ssd = run_once(scenario, attack, SSDDefense(epsilon=1.0), 0)
    assert ssd.success["acc@1"] <= none.success["acc@1"] - 0.2
    assert ssd.utility["accuracy"] >= none.utility["accuracy"] - 0.05
    assert ssd.utility["public_flip_rate"] > ssd.utility["test_flip_rate"]


def test_argmax_preserving_peers_leave_labels_unchanged():
    attack = ATTACKS[0]
    base = run_once(TINY, attack, None, 0)
    for peer in (ARTReverseSigmoid(), ARTRounded(decimals=3), ARTClassLabels()):
        result = run_once(TINY, attack, peer, 0)
        assert result.success["acc@1"] == base.success["acc@1"]
        assert result.utility["public_flip_rate"] == 0.0


def test_judge_rejects_bad_guesses():
    rng = np.random.default_rng(0)  # the draws of check_pair's chance check: cached
    task = TINY.setup(rng)
    system = TINY.learner().fit(task, rng)
    with pytest.raises(ValueError, match="needs reconstructions"):
        TINY.judge(system, task, None)
    with pytest.raises(ValueError, match="shape"):
        TINY.judge(system, task, np.zeros((3, 64)))
    bad = np.zeros((task.targets.size, 64))
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        TINY.judge(system, task, bad)


def test_judge_scores_private_images_as_perfect():
    rng = np.random.default_rng(0)  # the draws of check_pair's chance check: cached
    task = TINY.setup(rng)
    system = TINY.learner().fit(task, rng)
    picks = np.array([np.flatnonzero(task.train.y == t)[0] for t in task.targets])
    scores = TINY.judge(system, task, task.train.X[picks])
    assert scores["acc@1"] >= 0.95
    assert scores["verified_rate"] == 1.0
    assert scores["feature_dist"] == pytest.approx(0.0, abs=1e-9)


def test_voting_attack_jitters_only_against_hashing():
    calls: list[np.ndarray] = []

    def oracle(x: np.ndarray) -> np.ndarray:
        calls.append(np.array(x))
        return np.tile([0.9, 0.1], (x.shape[0], 1))

    attack = VotingBoundaryRepulsion(repeats=3, jitter=0.01)
    x = np.full((2, 4), 0.5)
    hashed = InversionView(
        oracle, x, np.zeros(2, np.int64), (0.0, 1.0), SSDDefense(seeding="input-hash")
    )  # type: ignore[arg-type]
    labels = attack.query_labels(hashed, x, np.random.default_rng(0))
    np.testing.assert_array_equal(labels, [0, 0])
    assert calls[-1].shape == (6, 4)
    assert np.any(calls[-1] != 0.5)
    plain = InversionView(oracle, x, np.zeros(2, np.int64), (0.0, 1.0), SSDDefense())  # type: ignore[arg-type]
    attack.query_labels(plain, x, np.random.default_rng(0))
    assert np.all(calls[-1] == 0.5)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: DigitsInversion(n_targets=0), r"n_targets must be an int in \[1, 5\]"),
        (lambda: DigitsInversion(n_targets=6), r"n_targets must be an int in \[1, 5\]"),
        (
            lambda: IdentitiesInversion(n_targets=51),
            r"IdentitiesInversion\.n_targets must be an int in \[1, 50\]",
        ),
        (lambda: DigitsInversion(queries=0), "queries must be an int >= 1"),
        (lambda: BoundaryRepulsion(iterations=0), "iterations must be an int >= 1"),
        (lambda: BoundaryRepulsion(inside=1.5), r"inside must lie in \(0, 1\]"),
        (lambda: BoundaryRepulsion(growth=0.5), "growth must be >= 1"),
        (lambda: GeneticInversion(elite=32), "elite must be < population"),
        (lambda: GeneticInversion(population=600), "population must be <= n_init"),
        (lambda: GeneticInversion(mutation_rate=0.0), "mutation_rate"),
        (
            lambda: VotingBoundaryRepulsion(jitter=-1.0),
            "jitter must be a finite number >= 0.0",
        ),
        (lambda: SSDDefense(epsilon=-1.0), "epsilon must be a finite number"),
        (lambda: SSDDefense(seeding="x"), "seeding must be one of"),
        (lambda: SSDDefense(hash_resolution=0.1), "needs seeding='input-hash'"),
        (lambda: ARTGaussianNoise(scale=0.0), "scale must be a finite number"),
        (lambda: ARTRounded(decimals=-1), "decimals must be an int"),
        (lambda: ARTHighConfidence(cutoff=2.0), "cutoff must be a finite number"),
        (lambda: ARTReverseSigmoid(beta=0.0), "beta must be a finite number"),
    ],
)
def test_bad_parameters(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


@pytest.mark.parametrize(
    "attack", [BoundaryRepulsion, GeneticInversion, VotingBoundaryRepulsion]
)
@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("n_components", 0, "n_components must be an int >= 1"),
        ("n_init", True, "n_init must be an int >= 1"),
        ("clamp", 0.0, "clamp must be a finite number > 0.0"),
        ("clamp", float("nan"), "clamp must be a finite number > 0.0"),
    ],
)
def test_every_prior_search_checks_the_prior_parameters(attack, field, value, match):
    with pytest.raises(ValueError, match=rf"{attack.__name__}\.{match}"):
        attack(**{field: value})


def test_query_budget_is_enforced():
    from defenses.oracle import QueryBudgetExceeded

    with pytest.raises(QueryBudgetExceeded):
        run_once(DigitsInversion(per_target=10, queries=100), ATTACKS[0], None, 0)
