"""The audit enforces the threat model: label-only access, auxiliary data, budget."""

import dataclasses

import pytest

from defenses.audit import audit, threat_model
from defenses.audit.examples import build_mlp
from defenses.audit.preflight import carve_validation
from defenses.audit.records import to_dataset
from defenses.reference.defense import Rounding
from defenses.ssd.attacks import BoundaryRepulsion, GeneticInversion
from defenses.threat import Capability

from .conftest import FAST

SCORE_BASED = ("loss-mia", "confidence-mia", "lira-offline", "ssd-mirror")
LABEL_BASED = ("label-only-mia", "ssd-brep")


def ran(report):
    """Names of the attacks that ran (labels carry non-default parameters)."""
    return {r.attack.split("(")[0] for r in report.results}


def test_labels_only_refuses_every_score_based_attack_by_name(cancer):
    model, members, non_members = cancer
    report = audit(
        model,
        members,
        non_members,
        threat=threat_model("labels"),
        defenses=[Rounding()],
        private_class=0,
        build_model=build_mlp,
        config=FAST,
    )
    refused = report.refused
    assert set(refused) == set(SCORE_BASED)
    for name in SCORE_BASED:
        assert f"attack {name!r}" in refused[name]
        assert Capability.QUERY_SCORES.value in refused[name]
    assert ran(report) == set(LABEL_BASED)
    markdown = report.to_markdown()
    assert markdown.index("predicted labels only") < markdown.index("## Membership")
    for name in SCORE_BASED:
        assert f"`{name}`" in markdown


def test_without_aux_data_lira_is_refused(cancer):
    model, members, non_members = cancer
    report = audit(
        model,
        members,
        non_members,
        threat=threat_model(aux_data=False),
        build_model=build_mlp,
        config=FAST,
    )
    assert "aux-data" in report.refused["lira-offline"]
    assert ran(report) == {
        "loss-mia",
        "confidence-mia",
        "label-only-mia",
    }


def test_query_budget_is_enforced_per_attack(cancer):
    model, members, non_members = cancer
    # the candidates: the members and the non-members left once the validation
    # split (the records defenses are fitted on) is carved from them
    kept = carve_validation(to_dataset("non", non_members, None)[0], None, None)
    n = len(members[1]) + len(kept.non_members)
    assert n < len(members[1]) + len(non_members[1])
    # enough for one pass over the candidates (membership), not for the inversion
    # attacks at their default strength (their first batch is 512 prior samples)
    strong = dataclasses.replace(
        FAST, brep=BoundaryRepulsion(), mirror=GeneticInversion()
    )
    report = audit(
        model,
        members,
        non_members,
        threat=threat_model(queries=n),
        private_class=0,
        config=strong,
    )
    assert "budget" in report.refused["ssd-brep"]
    assert "budget" in report.refused["ssd-mirror"]
    for r in report.results:
        assert r.cost["queries"] <= n
    assert ran(report) >= {"loss-mia", "label-only-mia"}
    # one query too few: even the membership attacks are refused
    short = audit(
        model, members, non_members, threat=threat_model(queries=n - 1), config=FAST
    )
    assert {"loss-mia", "confidence-mia", "label-only-mia"} <= set(short.refused)
    assert short.results == ()


@pytest.mark.parametrize("queries", [0, -1, 1.5, True])
def test_bad_budget_names_the_parameter(queries):
    with pytest.raises(ValueError, match="queries"):
        threat_model(queries=queries)
