"""Peers (ART) and ablations: same semantics as the library, seeded, no NaN."""

from __future__ import annotations

import numpy as np
import pytest

from defenses.ssd.arms import SSDDefense
from defenses.ssd.baselines import (
    ARTHighConfidence,
    ARTReverseSigmoid,
    ARTRounded,
    ConstantBudgetShield,
    NoTemperatureShield,
    SSDConstantBudget,
    SSDNoTemperature,
    class_labels,
    gaussian_noise,
)
from defenses.ssd.benchmark import speed
from defenses.ssd.defense import StealthyShield


def _probs(n: int = 40, k: int = 5, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.ones(k), n)


def test_gaussian_noise_matches_art_for_the_same_noise(monkeypatch):
    from art.defences.postprocessor import GaussianNoise

    probs = _probs()
    noise = np.random.default_rng(3).normal(0.0, 0.05, size=probs.shape)
    monkeypatch.setattr(np.random, "normal", lambda loc, scale, size: noise)
    expected = GaussianNoise(scale=0.05)(probs)
    np.testing.assert_allclose(gaussian_noise(probs, noise), expected, atol=1e-15)


def test_gaussian_noise_never_returns_nan():
    probs = _probs(k=3)
    out = gaussian_noise(probs, np.full(probs.shape, -1.0))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, 1 / 3)


@pytest.mark.parametrize(
    ("arm", "art_class", "params"),
    [
        (ARTReverseSigmoid, "ReverseSigmoid", {"beta": 0.5, "gamma": 0.2}),
        (ARTRounded, "Rounded", {"decimals": 2}),
        (ARTHighConfidence, "HighConfidence", {"cutoff": 0.3}),
    ],
)
def test_art_peers_answer_as_the_library_with_their_fields(arm, art_class, params):
    from art.defences import postprocessor

    probs = _probs()
    answer = arm(**params).build(None, None, np.random.default_rng(0))
    expected = getattr(postprocessor, art_class)(**params)(probs)
    np.testing.assert_array_equal(answer(probs, probs), expected)
    default = arm().build(None, None, np.random.default_rng(0))(probs, probs)
    assert not np.array_equal(default, expected)


def test_class_labels_fixes_art_batch_bug():
    from art.defences.postprocessor import ClassLabels

    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]])
    assert ClassLabels()(probs).sum() > 3  # the library bug this wrapper avoids
    np.testing.assert_array_equal(class_labels(probs), np.eye(3))


def test_ablation_shields():
    val = _probs(50, 4, 1)
    labels = np.arange(50) % 4
    probs = _probs(20, 4, 2)
    no_t = NoTemperatureShield(seed=0).fit(val, labels)
    np.testing.assert_allclose(no_t.sampling_probs(probs), probs)
    constant = ConstantBudgetShield(epsilon=0.2, seed=0).fit(val, labels)
    np.testing.assert_array_equal(constant.budgets(probs), 0.2)
    out = constant(probs)
    assert np.all(np.abs(out - probs).sum(axis=1) <= 0.2 + 1e-12)


@pytest.mark.parametrize(
    ("arm", "shield_class"),
    [
        (SSDDefense, StealthyShield),
        (SSDNoTemperature, NoTemperatureShield),
        (SSDConstantBudget, ConstantBudgetShield),
    ],
)
def test_each_arm_builds_its_shield_with_the_arm_parameters(arm, shield_class):
    defense = arm(epsilon=0.3, seeding="input-hash", hash_resolution=0.01)
    shield = defense.shield(seed=7)
    assert type(shield) is shield_class
    assert (shield.epsilon, shield.seed) == (0.3, 7)
    assert (shield.seeding, shield.hash_resolution) == ("input-hash", 0.01)


def test_speed_benchmark_records():
    params = {"K": 4, "N": 50, "repeats": 1, "cvxpy_rows": 2}
    results = {r.defense: r for r in speed(params, [0])}
    assert list(results) == [
        "none",
        "one_pass",
        "water_filling",
        "ssd",
        "ssd_threads",
        "ssd_input_hash",
        "ssd_labels",
        "ssd_no_projection",
        "art_reverse_sigmoid",
        "art_gaussian_noise",
        "art_rounded",
        "art_high_confidence",
        "water_filling_torch",
        "cvxpy",
    ]
    wf = results["water_filling"]
    assert wf.utility["objective_gap_vs_cvxpy"] <= 1e-6
    assert wf.utility["max_sum_error"] < 1e-12
    assert results["none"].cost["ratio_to_sort"] == 1.0
    assert results["one_pass"].cost["ratio_to_one_pass"] == 1.0
    assert results["cvxpy"].cost["speedup_vs_cvxpy"] == pytest.approx(1.0)
    ssd = results["ssd"]
    assert ssd.utility["max_sum_error"] < 1e-12
    assert ssd.utility["max_budget_excess"] <= 1e-12
    assert ssd.utility["meets_memory"] in (0.0, 1.0)
    assert ssd.cost["extra_memory_per_input_byte"] >= 1.0  # the answer itself
    assert results["ssd_threads"].cost["speedup_vs_one_thread"] > 0
    assert ssd.utility["target_passes"] == 4.0  # K = 4 <= 10
    for part in ("ssd_labels", "ssd_no_projection", "ssd_input_hash"):
        assert results[part].cost["per_row_us"] > 0
        assert results[part].cost["ratio_to_one_pass"] > 0


def test_passes_target_and_whole_budget_is_trivial():
    from defenses.ssd.benchmark import _WholeBudget, passes_target

    assert passes_target(10) == 4.0
    assert passes_target(11) == passes_target(1000) == 3.0
    rng = np.random.default_rng(0)
    val = rng.dirichlet(np.full(10, 0.3), 20)
    f = rng.dirichlet(np.full(10, 0.3), 200)
    shield = _WholeBudget(epsilon=2.0, seed=0, n_threads=1).fit(val, np.arange(20) % 10)
    labels = shield.pseudo_labels(f)
    shield.counter_ = np.uint64(0)
    # every row is answered by its pseudo-label's prototype: no projection ran
    np.testing.assert_array_equal(shield(f), shield.prototypes_[labels])


def test_speed_benchmark_rejects_bad_params():
    with pytest.raises(ValueError, match="unknown parameter"):
        list(speed({"K": 4, "bogus": 1}, [0]))
    with pytest.raises(ValueError, match="K must be an int >= 1"):
        list(speed({"K": 0}, [0]))
    with pytest.raises(ValueError, match="max_budget"):
        list(speed({"K": 4, "max_budget": 3.0}, [0]))
