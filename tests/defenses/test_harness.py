import json

import pytest

from defenses.harness import evaluate, label, measurement, run_once
from defenses.results import paired_deltas
from defenses.testing import ContractError, check_pair
from defenses.threat import Capability, ThreatModel, ThreatModelViolation

from .toy import Blur, MutatingDefense, NeedsWeights, ReadScores, ToyScenario


def test_refuses_an_attack_the_threat_model_does_not_grant():
    with pytest.raises(ThreatModelViolation, match=r"needs-weights.*read-parameters"):
        run_once(ToyScenario(), NeedsWeights(), None, 0)
    with pytest.raises(ThreatModelViolation, match="read-parameters"):
        next(evaluate(ToyScenario(), NeedsWeights(), [None], [0]))


def test_arms_share_split_and_init_seed_by_seed():
    results = list(evaluate(ToyScenario(), ReadScores(), [None, Blur()], [0, 1]))
    assert [(r.seed, r.defense) for r in results] == [
        (0, "none"),
        (0, "blur"),
        (1, "none"),
        (1, "blur"),
    ]
    draws = [r.utility["init_draw"] for r in results]
    assert draws[0] == draws[1]
    assert draws[2] == draws[3]
    assert draws[0] != draws[2]


def test_result_records_everything_and_is_json():
    result = run_once(
        ToyScenario(queries=500), ReadScores(), Blur(0.2), 3, {"spec": "x"}
    )
    assert result.success["accuracy"] == 1.0
    assert result.cost["queries"] == 200
    assert result.cost["fit_s"] >= 0
    assert result.params["defense"] == {"noise": 0.2}
    assert result.params["scenario"] == {"n": 200, "queries": 500}
    assert result.threat["capabilities"] == ["query-scores"]
    assert result.meta["spec"] == "x"
    assert "numpy" in result.meta
    json.dumps(result.to_dict())


def test_paired_deltas_subtract_the_same_seed():
    results = list(evaluate(ToyScenario(), ReadScores(), [None, Blur()], [0, 1, 2]))
    ((first, cells),) = paired_deltas(results, ["success.accuracy", "utility.accuracy"])
    assert first.defense == "blur"
    assert cells["utility.accuracy"].mean == pytest.approx(-0.6)
    assert cells["success.accuracy"].n == 3


def test_label_lists_fields_that_differ_from_defaults():
    assert label(None) == "none"
    assert label(Blur()) == "blur"
    assert label(Blur(0.25)) == "blur(noise=0.25)"


def test_measurement_records_validate_metrics():
    record = measurement("speed", "fast", 0, cost={"time_s": 1.0}, params={"K": 10})
    assert record.params == {"benchmark": {"K": 10}}
    with pytest.raises(ValueError, match="must be finite"):
        measurement("speed", "fast", 0, cost={"time_s": float("inf")})
    assert record.threat == {}


def test_measurement_records_carry_a_threat_model_when_given():
    threat = ThreatModel.granting("integrity", Capability.POISON_TRAIN)
    record = measurement("certify", "rps", 0, threat=threat)
    assert record.threat == threat.to_dict()
    assert record.threat["capabilities"] == ["poison-train"]
    assert (record.threat["stage"], record.threat["knowledge"]) == (
        "training",
        "black-box",
    )


def test_check_pair_accepts_a_sound_pair():
    undefended, defended = check_pair(ToyScenario(queries=200), ReadScores(), Blur())
    assert undefended.success["accuracy"] > defended.success["accuracy"]


def test_check_pair_catches_a_mutating_wrap():
    with pytest.raises(ContractError, match="mutated"):
        check_pair(ToyScenario(), ReadScores(), MutatingDefense())


def test_check_pair_catches_an_oracle_over_budget():
    with pytest.raises(Exception, match="budget"):
        check_pair(ToyScenario(queries=100), ReadScores(), Blur())


def test_check_pair_catches_a_broken_judge():
    class AlwaysRight(ToyScenario):
        def judge(self, system, task, guess):
            return {"accuracy": 1.0}

    with pytest.raises(ContractError, match="blind guess"):
        check_pair(AlwaysRight(), ReadScores(), Blur())


def test_check_pair_catches_a_weak_attack():
    with pytest.raises(ContractError, match=r"not .*clearly above chance"):
        check_pair(ToyScenario(), ReadScores(), Blur(), min_gap=0.6)


def test_import_defenses_is_light():
    """``import defenses`` pulls no heavy library (issue 20: under 2 s)."""
    import subprocess
    import sys

    heavy = ("torch", "sklearn", "scipy", "matplotlib", "numba", "tqdm", "asyncio")
    code = (
        "import sys, time; start = time.perf_counter(); import defenses; "
        "print(time.perf_counter() - start); "
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[1] == "", f"import defenses pulls in {out[1]}"
    assert float(out[0]) < 2.0
