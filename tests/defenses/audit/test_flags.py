"""Flags read the distance from chance, with a paired interval; degenerate answers warn.

Issue 39 item 5: an AUC below chance moving towards 0.5 (0.433 -> 0.507) is a weaker
attack, never a stronger one; one seed never flags; constant or label-independent
answers warn on stderr and in the report. Issue 40: the title names the model.
Issue 41: the reporting layers import no circle, annotations included.
"""

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer

from defenses.audit import audit
from defenses.audit.findings import Findings
from defenses.audit.preflight import AuditInputWarning, degenerate_answers
from defenses.audit.report import AuditReport
from defenses.audit.threats import threat_model
from defenses.audit.verdict import falls, rises, shifts, summary_lines, verdict
from defenses.data import Dataset
from defenses.results import UNDEFENDED, Result

from .conftest import FAST


def run(defense, seed, auc, attack="loss-mia"):
    return Result(
        scenario="audit",
        attack=attack,
        defense=defense,
        seed=seed,
        threat={},
        utility={"accuracy": 0.9},
        success={"auc": auc},
        cost={},
        meta={"kind": "membership"},
    )


def report(pairs, attack="loss-mia"):
    """An AuditReport from (undefended AUC, defended AUC) per seed."""
    results = []
    for seed, (plain, defended) in enumerate(pairs):
        results += [run(UNDEFENDED, seed, plain, attack), run("arm", seed, defended)]
    return AuditReport(
        name="flags",
        threat=threat_model(),
        results=tuple(results),
        curves=(),
        refusals=(),
        data={
            "n_classes": 2,
            "members": 100,
            "non_members": 100,
            "test": 100,
            "validation": 25,
            "input_shape": [4],
        },
        settings={
            "seeds": list(range(len(pairs))),
            "confidence": 0.95,
            "delta": 1e-5,
        },
    )


def test_auc_below_chance_moving_to_chance_is_weaker_not_stronger():
    """The issue's case: 0.433 -> 0.507 is an attack losing its signal."""
    found = report([(0.433, 0.507), (0.431, 0.505), (0.436, 0.509)])
    assert not rises(found)
    assert [(s.attack, s.defense) for s in falls(found)] == [("loss-mia", "arm")]
    page = found.to_markdown()
    assert "arm **WEAKER**" in page
    assert "**STRONGER**" not in page
    assert "most protective arm, `arm`" in verdict(found)
    assert found.to_dict()["weaker"]
    assert not found.to_dict()["stronger"]


def test_auc_moving_away_from_chance_below_it_is_stronger():
    found = report([(0.45, 0.30), (0.46, 0.31), (0.44, 0.29)])
    assert [s.defense for s in rises(found)] == ["arm"]
    assert "arm **STRONGER**" in found.to_markdown()
    assert any(line.startswith("  STRONGER") for line in summary_lines(found, {}))


def test_mirror_images_are_equally_strong():
    """0.3 and 0.7 are the same distance from chance: no flag either way."""
    assert not shifts(report([(0.30, 0.70), (0.31, 0.69), (0.29, 0.71)]))


def test_one_seed_never_flags():
    found = report([(0.50, 0.99)])
    assert not shifts(found)
    assert "one seed gives no interval" in verdict(found)


def test_noisy_seeds_whose_interval_holds_zero_do_not_flag():
    # mean change +0.05, but the seeds disagree in sign: the interval holds 0
    assert not shifts(report([(0.60, 0.75), (0.60, 0.56), (0.60, 0.64)]))


def test_a_small_consistent_change_within_the_tolerance_does_not_flag():
    assert not shifts(report([(0.60, 0.605), (0.61, 0.615), (0.62, 0.625)]))


def records(X, y):
    labels = np.asarray(y, dtype=np.int64)
    return Dataset(np.asarray(X, dtype=np.float64), labels, "records", 2)


@pytest.fixture(scope="module")
def cancer_records():
    X, y = load_breast_cancer(return_X_y=True)
    return X[:300], y[:300]


@pytest.mark.parametrize(
    ("row", "words"),
    [([0.5, 0.5], "uniform"), ([0.0, 1.0], "one-hot on class 1"), ([0.2, 0.8], "0.2")],
)
def test_constant_answers_are_named(cancer_records, row, words):
    X, y = cancer_records

    def predict(rows):
        return np.tile(row, (rows.shape[0], 1))

    reasons = degenerate_answers(predict, [records(X, y)])
    assert len(reasons) == 1
    assert "same probabilities for every one" in reasons[0]
    assert words in reasons[0]


def test_label_independent_answers_are_named(cancer_records):
    X, y = cancer_records
    noise = np.random.default_rng(1).dirichlet([1.0, 1.0], size=len(y))

    def predict(rows):
        return noise[: rows.shape[0]]

    reasons = degenerate_answers(predict, [records(X, y)])
    assert len(reasons) == 1
    assert "do not depend on the labels" in reasons[0]


def test_a_model_that_learned_the_labels_is_not_flagged(cancer):
    model, members, non_members = cancer
    assert not degenerate_answers(
        model.predict_proba, [records(*members), records(*non_members)]
    )


class Constant:
    """A 'model' that answers uniform probabilities whatever it is asked."""

    classes_ = np.array([0, 1])

    def predict_proba(self, X):
        return np.full((np.asarray(X).shape[0], 2), 0.5)


def test_constant_model_warns_on_stderr_and_in_the_report(cancer):
    _, members, non_members = cancer
    with pytest.warns(AuditInputWarning, match="same probabilities"):
        found = audit(Constant(), members, non_members, config=FAST)
    assert any("same probabilities" in w for w in found.warnings)
    page = found.to_markdown()
    assert "same probabilities for every one" in page
    assert "warning(s) about the inputs or the model's answers" in page
    # outside pytest's warning capture, the same warning reaches stderr
    code = (
        "from defenses.audit.preflight import warn_all\n"
        "warn_all(['the model answers the same probabilities'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert "AuditInputWarning: audit: the model answers the same" in done.stderr


def test_the_title_names_the_model(cancer):
    model, members, non_members = cancer
    found = audit(model, members, non_members, config=FAST)
    title = found.to_markdown().splitlines()[0]
    assert title == f"# Privacy audit: {type(model).__name__}"
    assert title != "# Privacy audit: audit"
    named = audit(model, members, non_members, config=FAST, name="my-model")
    assert named.to_markdown().startswith("# Privacy audit: my-model\n")


AUDIT = Path(__file__).resolve().parents[3] / "defenses" / "audit"


def imported(module):
    """Every defenses.audit module ``module`` imports, annotations included."""
    tree = ast.parse((AUDIT / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "defenses.audit."
        ):
            found.add(node.module.removeprefix("defenses.audit."))
    return found


def test_reporting_layers_import_no_circle():
    """findings <- verdict <- plots <- report, even under TYPE_CHECKING."""
    assert not imported("findings") & {"verdict", "plots", "report"}
    assert not imported("verdict") & {"plots", "report"}
    assert not imported("plots") & {"report"}
    assert issubclass(AuditReport, Findings)
