"""Issue #32: the paired interval and the DP learners' post-processing options."""

import dataclasses

import numpy as np
import pytest
from scipy import stats

from defense_suite.federated.arms import IDPFedAvg, TimeAdaptiveDP
from defense_suite.federated.postprocess import lr_scales, noise_weights
from defense_suite.federated.scenario import FederatedMembership
from defense_suite.federated.schedule import TimeAdaptive, Uniform, plan_schedules
from defense_suite.federated.training import fedavg
from defenses.results import (
    Interval,
    interval_outcome,
    paired_differences,
    t_interval,
)
from defenses.testing import make_result

TINY = {
    "n_clients": 4,
    "rounds": 6,
    "local_steps": 5,
    "batch_rate": 1.0,
    "member_fraction": 0.1,
    "lr": 2.0,
    "budgets": [0.5, 4.0, 8.0],
}


def _result(defense, seed, acc, scenario=None):
    params = {"scenario": scenario or {"rounds": 1}}
    return make_result(defense, seed, utility={"accuracy": acc}, params=params)


def test_t_interval_matches_scipy():
    values = [0.02, 0.01, 0.03, -0.005, 0.015, 0.025]
    got = t_interval(values)
    low, high = stats.t.interval(
        0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values)
    )
    assert got.low == pytest.approx(low)
    assert got.high == pytest.approx(high)
    assert got.n == 6
    assert got.excludes_zero
    assert t_interval(values, 0.5).high < got.high


@pytest.mark.parametrize(
    ("values", "level", "match"),
    [
        ([0.1], 0.95, "at least 2"),
        ([0.1, 0.2], 1.0, "level"),
        ([0.1, np.nan], 0.9, "finite"),
    ],
)
def test_t_interval_bad_input(values, level, match):
    with pytest.raises(ValueError, match=match):
        t_interval(values, level)


def test_paired_differences_pair_by_seed_and_setting():
    base = [_result("u", s, 0.5 + 0.1 * s) for s in range(3)]
    base.append(_result("u", 0, 0.0, {"rounds": 2}))
    defended = [_result("t", s, 0.52 + 0.1 * s) for s in (2, 0, 1, 7)]
    diffs = paired_differences(defended, base, "utility.accuracy")
    assert diffs == pytest.approx([0.02, 0.02, 0.02])  # seed 7 has no partner
    with pytest.raises(ValueError, match="share the pairing key"):
        paired_differences(defended, [*base, base[0]], "utility.accuracy")


def test_interval_outcome():
    assert interval_outcome(Interval(0.02, 0.01, 0.03, 8), "higher") == "reproduced"
    assert interval_outcome(Interval(0.02, 0.01, 0.03, 8), "lower") == "contradicted"
    assert interval_outcome(Interval(0.0, -0.01, 0.01, 8), "higher") == "inconclusive"
    assert interval_outcome(Interval(-0.02, -0.03, -0.01, 8), "higher") == (
        "contradicted"
    )
    with pytest.raises(ValueError, match="direction"):
        interval_outcome(Interval(0.0, -0.01, 0.01, 8), "same")


def _plans(policy):
    return plan_schedules(
        [0.5, 4.0, 8.0], policy, delta=1e-5, rounds=20, steps=4, sigma=2.0
    )


def test_lr_scales_keep_the_mean_rate_and_follow_the_phase():
    scales = lr_scales(_plans(TimeAdaptive(0.7, 0.9)))
    for row in scales:
        assert np.mean(row) == pytest.approx(1.0)
        assert row[0] < 1.0 < row[-1]  # saving rounds step less, spending more
    assert all(
        s == pytest.approx(1.0) for row in lr_scales(_plans(Uniform())) for s in row
    )


def test_noise_weights_sum_to_one_and_favour_less_noisy_updates():
    plans = _plans(Uniform())
    weights = noise_weights(plans, [100, 100, 100])
    for row in weights:
        assert sum(row) == pytest.approx(1.0)
        assert row[0] < row[1] < row[2]  # the strictest client has the lowest rate
    # A client with twice the data and the same rate has 4x the weight.
    equal = plan_schedules(
        [4.0, 4.0], Uniform(), delta=1e-5, rounds=5, steps=4, sigma=2.0
    )
    assert noise_weights(equal, [200, 100])[0] == pytest.approx([0.8, 0.2])


def test_fedavg_rejects_bad_weights():
    base = [np.zeros(2)]
    updates = [[np.ones(2)], [np.zeros(2)]]
    rng = np.random.default_rng(0)
    assert fedavg(base, updates, [3.0, 1.0], rng)[0] == pytest.approx([0.75, 0.75])
    for bad in ([1.0], [1.0, -1.0], [0.0, 0.0], [np.nan, 1.0]):
        with pytest.raises(ValueError, match="weight"):
            fedavg(base, updates, bad, rng)


@pytest.mark.parametrize(
    "method",
    [
        TimeAdaptiveDP(
            sigma=2.0, save_fraction=0.5, save_ratio=0.9, lr_follows_batch=True
        ),
        TimeAdaptiveDP(
            sigma=2.0, save_fraction=0.5, save_ratio=0.9, noise_weighted=True
        ),
        IDPFedAvg(sigma=2.0, noise_weighted=True),
    ],
    ids=["lr", "weights", "idp-weights"],
)
def test_options_leave_every_clients_epsilon_unchanged(method):
    """Red team: an option must not change what any client's data is exposed to.

    Same plans, same recorded histories, same certificate as without the option,
    while the trained model does change (the option is not a no-op).
    """
    scenario = FederatedMembership(**TINY)
    task = scenario.setup(np.random.default_rng(0))
    plain = dataclasses.replace(method, lr_follows_batch=False, noise_weighted=False)
    fitted = method.wrap(scenario.learner()).fit(task, np.random.default_rng(1))
    base = plain.wrap(scenario.learner()).fit(task, np.random.default_rng(1))
    assert fitted.histories == base.histories
    assert method.certify(fitted, task) == plain.certify(base, task)
    assert method.certify(fitted, task)["spent_ratio_max"] <= 1.0
    assert not all(
        np.array_equal(a, b) for a, b in zip(fitted.params, base.params, strict=True)
    )


def test_option_flags_must_be_booleans():
    with pytest.raises(ValueError, match="lr_follows_batch"):
        TimeAdaptiveDP(lr_follows_batch="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise_weighted"):
        IDPFedAvg(noise_weighted=1)  # type: ignore[arg-type]


def test_regime_specs_parse():
    from defense_suite.spec import load_spec

    for name in ("federated_regime-quick", "federated_regime-full"):
        spec = load_spec(f"benchmarks/specs/{name}.toml")
        assert spec.report.summary is not None
        assert spec.name == name


def test_accuracy_per_group_is_on_each_groups_held_out_records():
    """Per-group accuracy counts only non-members of that group's clients."""
    scenario = FederatedMembership(**{**TINY, "rounds": 2})
    task = scenario.setup(np.random.default_rng(0))
    model = scenario.learner().fit(task, np.random.default_rng(1))
    out = scenario.utility(model, task)
    correct = (
        np.argmax(model.predict_proba(task.candidates), axis=1) == task.candidate_labels
    )
    for group in ("strict", "moderate", "relaxed"):
        mask = ~task.is_member & (task.candidate_groups == group)
        assert out[f"accuracy_{group}"] == pytest.approx(np.mean(correct[mask]))


def _sweep_result(defense, seed, acc, rounds, ratio=0.9, **options):
    return make_result(
        defense,
        seed,
        scenario="federated-membership",
        attack="federated-loss-mia",
        utility={"accuracy": acc},
        params={
            "scenario": {"dataset": "digits", "rounds": rounds, "budgets": [1, 2]},
            "defense": {"save_ratio": ratio, **options},
        },
        meta={"spec": "federated_regime-full"},
    )


def _sweep(gain):
    rows = []
    for rounds in (30, 120):
        for seed in range(4):
            noise = 0.001 * seed
            rows.append(_sweep_result(UNIFORM_ARM, seed, 0.5 + noise, rounds))
            # The noise-weighted uniform arm is an option, never the baseline.
            rows.append(
                _sweep_result(
                    UNIFORM_ARM + "-nw", seed, 0.9, rounds, noise_weighted=True
                )
            )
            for ratio in (0.5, 0.9):
                acc = 0.5 + gain[(rounds, ratio)] + 2 * noise
                rows.append(
                    _sweep_result(f"{TA_ARM}({ratio})", seed, acc, rounds, ratio)
                )
    return rows


UNIFORM_ARM = "federated-idp-fedavg(sigma=2.0)"
TA_ARM = "federated-time-adaptive"


def test_sweep_cells_classify_help_nothing_and_hurt(tmp_path):
    from defense_suite.federated.figures import figures
    from defense_suite.federated.regime import sweep_cells

    gain = {(30, 0.5): -0.1, (30, 0.9): 0.0, (120, 0.5): -0.02, (120, 0.9): 0.03}
    cells = sweep_cells(_sweep(gain))
    assert len(cells) == 4
    got = {(c.rounds, c.save_ratio): c for c in cells}
    assert got[(120, 0.9)].outcome == "helps"
    assert got[(120, 0.9)].interval.mean == pytest.approx(0.03 + 0.0015)
    assert got[(30, 0.5)].outcome == "hurts"
    assert got[(30, 0.9)].outcome == "nothing"  # a seed-only spread straddles 0
    drawn = [p.name for _, p in figures(_sweep(gain), tmp_path)]
    assert "federated_regime_sweep.png" in drawn
    assert (tmp_path / "federated_regime_sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_paired_interval_on_the_regime_shaped_results():
    from defenses.results import paired_interval

    base = [_result("u", s, 0.40 + 0.01 * s) for s in range(6)]
    better = [_result("t", s, 0.42 + 0.01 * s + 0.001 * (s % 2)) for s in range(6)]
    interval, outcome = paired_interval(better, base, "utility.accuracy", "higher")
    assert outcome == "reproduced"
    assert interval.n == 6
    assert interval.low > 0
    # One seed cannot form an interval: no verdict rather than a false one.
    assert paired_interval(better[:1], base, "utility.accuracy", "higher") is None
    # Pure seed noise around 0 is inconclusive, whatever its relative size.
    noisy = [_result("t", s, 0.40 + 0.01 * s + (-1) ** s * 0.02) for s in range(6)]
    assert paired_interval(noisy, base, "utility.accuracy", "higher")[1] == (
        "inconclusive"
    )
