import pytest

from defenses.threat import (
    Budget,
    Capability,
    Goal,
    Knowledge,
    Stage,
    ThreatModel,
    ThreatModelViolation,
)


def scores_model(**kw):
    base = dict(
        goal=Goal.CONFIDENTIALITY,
        stage=Stage.DEPLOYMENT,
        knowledge=Knowledge.BLACK_BOX,
        capabilities=frozenset({Capability.QUERY_SCORES}),
    )
    base.update(kw)
    return ThreatModel(**base)


def test_require_names_the_missing_capability():
    threat = scores_model()
    threat.require({Capability.QUERY_SCORES}, "attack x")
    with pytest.raises(ThreatModelViolation, match="attack y needs read-parameters"):
        threat.require(
            {Capability.READ_PARAMETERS, Capability.QUERY_SCORES}, "attack y"
        )


def test_strings_are_coerced_and_serialized():
    threat = scores_model(goal="integrity", capabilities=frozenset({"query-scores"}))
    assert threat.goal is Goal.INTEGRITY
    assert threat.to_dict()["capabilities"] == ["query-scores"]
    assert threat.to_dict()["budget"]["queries"] is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capabilities": frozenset()}, "must not be empty"),
        ({"knowledge": Knowledge.WHITE_BOX}, "white-box exactly when"),
        ({"stage": Stage.TRAINING}, "training' exactly when"),
        (
            {"capabilities": frozenset({Capability.POISON_TRAIN})},
            "training' exactly when",
        ),
        (
            {
                "capabilities": frozenset({Capability.AUX_DATA}),
                "budget": Budget(queries=10),
            },
            "needs a query capability",
        ),
        ({"budget": Budget(poison_fraction=0.1)}, "needs a poisoning capability"),
        ({"goal": "stealing"}, "stealing"),
    ],
)
def test_inconsistent_threat_models_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        scores_model(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"queries": -1}, r"Budget.queries must be finite and >= 0, got -1"),
        ({"poison_fraction": 1.5}, r"poison_fraction must lie in \[0, 1\]"),
        ({"radius": 0.1}, "radius and Budget.norm go together"),
        ({"radius": 0.1, "norm": "l3"}, "norm must be one of"),
        ({"radius": float("nan"), "norm": "l2"}, "radius must be finite"),
    ],
)
def test_bad_budgets_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Budget(**kwargs)


def test_budget_queries_must_be_an_integer():
    with pytest.raises(TypeError, match="queries must be an int"):
        Budget(queries=1.5)  # type: ignore[arg-type]


def test_granting_implies_stage_and_white_box_knowledge():
    from defenses.threat import Budget, Capability, Knowledge, Stage, ThreatModel

    poison = ThreatModel.granting(
        "integrity", "poison-train", "poison-calibration", knowledge="gray-box"
    )
    assert poison.stage is Stage.TRAINING
    assert poison.knowledge is Knowledge.GRAY_BOX
    white = ThreatModel.granting(
        "integrity", Capability.READ_PARAMETERS, budget=Budget(radius=0.1, norm="linf")
    )
    assert white.stage is Stage.DEPLOYMENT
    assert white.knowledge is Knowledge.WHITE_BOX
    assert white == ThreatModel(
        goal="integrity",
        stage="deployment",
        knowledge="white-box",
        capabilities=frozenset({Capability.READ_PARAMETERS}),
        budget=Budget(radius=0.1, norm="linf"),
    )


def test_budget_accepts_numpy_numbers_as_python_ones():
    import numpy as np

    from defenses.threat import Budget

    budget = Budget(queries=np.int64(50), poison_fraction=np.float32(0.25))
    assert budget.queries == 50
    assert type(budget.queries) is int
    assert type(budget.poison_fraction) is float
    assert budget.to_dict()["queries"] == 50
