"""The audit measures the model as it is, says when its inputs mislead, and flags
defenses that make an attack stronger.

Red team: a model whose rows are off the simplex or NaN must be refused (never a
number); a random forest's exact ties must reach the ROC unmoved; a "defense" built
to leak more must be flagged in the report and the command's summary; no defense may
be fitted on the records the audit evaluates.
"""

import argparse
import dataclasses
import sys
import textwrap
import types
from typing import ClassVar

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.ensemble import RandomForestClassifier

from defenses.api import DefenseKind
from defenses.audit import audit, cli
from defenses.audit.plots import MIN_ACCURACY_SPAN, accuracy_range
from defenses.audit.preflight import MIN_RECORDS, AuditInputWarning, carve_validation
from defenses.audit.records import to_dataset
from defenses.audit.spec import load_spec
from defenses.audit.target import as_audited
from defenses.audit.verdict import rises, summary_lines
from defenses.metrics import membership_metrics
from defenses.results import UNDEFENDED

from .conftest import FAST


@pytest.fixture(scope="module")
def forest():
    """A random forest on digits: its probabilities are multiples of 1/100 (ties)."""
    X, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(y.size)
    members, non = order[:300], order[300:600]
    model = RandomForestClassifier(n_estimators=100, random_state=0)
    model.fit(X[members], y[members])
    return model, (X[members], y[members]), (X[non], y[non])


# --- the model as it is ----------------------------------------------------------


def test_answers_are_passed_on_unchanged_and_ties_reach_the_roc(forest):
    model, members, non_members = forest
    audited = as_audited(model, (64,))
    raw = model.predict_proba(non_members[0])
    assert np.array_equal(audited.predict_proba(non_members[0]), raw)  # bit for bit
    assert not np.array_equal(raw, raw / raw.sum(axis=1, keepdims=True))
    report = audit(model, members, non_members, config=FAST)
    kept = carve_validation(to_dataset("n", non_members, None)[0], None, None)
    scores = np.r_[
        model.predict_proba(members[0]).max(1),
        model.predict_proba(kept.non_members.X).max(1),
    ]
    bits = np.r_[np.ones(300, bool), np.zeros(len(kept.non_members), bool)]
    assert np.unique(scores).size < scores.size / 4  # many exact ties
    expected = membership_metrics(scores, bits)["auc"]
    got = report.result("confidence-mia", UNDEFENDED, 0).success["auc"]
    assert got == expected


def test_rows_off_the_simplex_are_refused_naming_the_model(forest):
    model, members, non_members = forest

    def loose(X):
        return model.predict_proba(X) * 1.01

    with pytest.raises(ValueError, match=r"model \(.*loose\)'s answers are not prob"):
        audit(loose, members, non_members, config=FAST)

    def negative(X):
        out = model.predict_proba(X)
        out[:, 0] -= 0.01
        out[:, 1] += 0.01
        return out

    with pytest.raises(ValueError, match="smallest entry"):
        audit(negative, members, non_members, config=FAST)


def test_non_finite_outputs_are_refused_by_name():
    digits = load_digits()
    X = digits.data / 16.0
    net = torch.nn.Sequential(torch.nn.Linear(64, 10))
    with torch.no_grad():
        net[0].bias[3] = float("nan")
    with pytest.raises(
        ValueError,
        match=r"model \(Sequential\) has NaN or inf in its "
        r"parameter '0.bias'",
    ):
        audit(net, (X[:60], digits.target[:60]), (X[60:120], digits.target[60:120]))

    class Overflow(torch.nn.Module):
        def forward(self, x):
            return torch.full((x.shape[0], 10), float("inf"))

    with pytest.raises(ValueError, match=r"model \(Overflow\) answered NaN or inf"):
        audit(Overflow(), (X[:60], digits.target[:60]), (X[60:120], digits.target[60:]))

    def nan_rows(rows):
        out = np.full((len(rows), 10), 0.1)
        out[len(rows) // 2] = np.nan
        return out

    with pytest.raises(
        ValueError, match=r"nan_rows\) answered NaN or inf \(rows \[0\]"
    ):
        audit(nan_rows, (X[:60], digits.target[:60]), (X[60:120], digits.target[60:]))


def test_a_softmax_ending_module_is_not_softmaxed_twice(forest):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 10)
    ending = as_audited(torch.nn.Sequential(linear, torch.nn.Softmax(dim=1)), (64,))
    logits = as_audited(linear, (64,))
    X = forest[1][0][:20]
    np.testing.assert_allclose(
        ending.predict_proba(X), logits.predict_proba(X), rtol=1e-5, atol=1e-7
    )


# --- degenerate inputs -------------------------------------------------------------


def test_degenerate_inputs_warn_in_the_report_and_on_stderr(forest):
    model, (X, y), (Xn, yn) = forest
    few = MIN_RECORDS - 20
    with pytest.warns(AuditInputWarning, match=f"only {few} members"):
        report = audit(model, (X[:few], y[:few]), (Xn, yn), config=FAST)
    assert any(f"only {few} members" in w for w in report.warnings)
    assert "## Input warnings" in report.to_markdown()
    with pytest.warns(AuditInputWarning, match="members and non-members are the same"):
        same = audit(model, (X, y), (X, y), config=FAST)
    assert "Read the numbers with care" in same.to_markdown()
    one = y == 3
    with pytest.warns(AuditInputWarning, match="single class"):
        audit(model, (X[one], y[one]), (Xn, yn), config=FAST)
    with pytest.warns(AuditInputWarning, match="validation rows are also members"):
        audit(model, (X, y), (Xn, yn), validation=(X[:40], y[:40]), config=FAST)


def test_clean_inputs_do_not_warn(forest, recwarn):
    model, members, non_members = forest
    report = audit(model, members, non_members, config=FAST)
    assert report.warnings == ()
    assert not [w for w in recwarn if issubclass(w.category, AuditInputWarning)]


# --- no defense fitted on evaluation records ---------------------------------------


@dataclasses.dataclass(frozen=True)
class Spy:
    """A post-processing 'defense' that records the rows it was fitted on."""

    name: ClassVar[str] = "spy"
    kind: ClassVar[DefenseKind] = DefenseKind.POSTPROCESSOR
    seen: list = dataclasses.field(default_factory=list)

    def wrap(self, learner):
        spy = self

        class Fitted:
            def fit(self, data, rng):
                spy.seen.append((data.val.X, data.test.X, data.non_members.X))
                return learner.fit(data, rng)

        return Fitted()


@pytest.mark.parametrize("given_test", [False, True])
def test_defenses_are_never_fitted_on_evaluated_records(forest, given_test):
    model, members, (Xn, yn) = forest
    spy = Spy()
    test = (Xn[200:], yn[200:]) if given_test else None
    report = audit(
        model, members, (Xn[:200], yn[:200]), test=test, defenses=[spy], config=FAST
    )
    val, tst, non = spy.seen[0]
    rows = {r.tobytes() for r in val}
    assert rows
    assert not rows & {r.tobytes() for r in tst}
    assert not rows & {r.tobytes() for r in non}
    assert not rows & {r.tobytes() for r in np.asarray(members[0], dtype=float)}
    where = "test records" if given_test else "non-members"
    assert f"carved from the {where}" in report.data["validation_source"]
    assert f"carved from the {where}" in report.to_markdown()


# --- arms that make an attack stronger ----------------------------------------------


class Leaky:
    """An ART-style post-processor that answers members' rows one-hot (it leaks)."""

    params: ClassVar[list[str]] = []
    apply_predict = True

    def __init__(self, member_answers):
        self.members = {row.tobytes() for row in member_answers}

    def __call__(self, preds):
        out = np.array(preds, dtype=np.float64)
        for i, row in enumerate(out):
            if row.tobytes() in self.members:
                out[i] = np.eye(out.shape[1])[row.argmax()]
        return out


class Identity:
    """An ART-style post-processor that changes nothing (must not be flagged)."""

    params: ClassVar[list[str]] = []
    apply_predict = True

    def __call__(self, preds):
        return preds


def test_an_arm_that_raises_an_attack_is_flagged(forest, tmp_path):
    model, members, non_members = forest
    leaky = Leaky(model.predict_proba(members[0]))
    config = dataclasses.replace(FAST, seeds=(0, 1))
    report = audit(
        model, members, non_members, defenses=[leaky, Identity()], config=config
    )
    flagged = {(r.attack, r.defense) for r in rises(report)}
    assert ("confidence-mia", "art-Leaky") in flagged
    assert not {d for _, d in flagged} & {"art-Identity", UNDEFENDED}
    page = report.to_markdown()
    assert "art-Leaky **STRONGER**" in page
    verdict = page.split("\n\n")[1]
    assert verdict.startswith("**Verdict.**")
    assert "art-Leaky makes confidence-mia stronger" in verdict
    assert "± 0.000" not in page  # deterministic numbers print without a spread
    assert "STRONGER" in "\n".join(summary_lines(report, {}))
    assert report.to_dict()["stronger"]


def test_accuracy_axis_is_never_a_zoom():
    low, high = accuracy_range([0.991, 0.995, 0.993])
    assert high - low >= MIN_ACCURACY_SPAN
    assert low <= 0.8
    assert accuracy_range([0.42, 0.9])[0] <= 0.4


# --- the command: summary, and a loader beside the spec -----------------------------


LOADER = """
import numpy as np
from sklearn.datasets import load_breast_cancer
from sklearn.tree import DecisionTreeClassifier

from defenses.audit.inputs import AuditInputs

MARK = {mark!r}


def load():
    X, y = load_breast_cancer(return_X_y=True)
    model = DecisionTreeClassifier(max_depth=4, random_state=0).fit(X[:200], y[:200])
    return AuditInputs(model, (X[:200], y[:200]), (X[200:400], y[200:400]))
"""

SPEC = """
name = "beside"
loader = "{module}:load"
defenses = []
seeds = [0]
"""


def test_loader_beside_the_spec_is_found_and_the_summary_printed(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))  # not the spec's folder
    for folder in ("a", "b"):  # two specs, two neighbours of the same name
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "own_model.py").write_text(
            textwrap.dedent(LOADER.format(mark=folder))
        )
        (tmp_path / folder / "audit.toml").write_text(SPEC.format(module="own_model"))
    caller_own_model = types.ModuleType("own_model")  # the caller's module of that name
    monkeypatch.setitem(sys.modules, "own_model", caller_own_model)
    for folder in ("a", "b"):
        spec = load_spec(tmp_path / folder / "audit.toml")
        assert spec.loader.__globals__["MARK"] == folder
        # the neighbour is imported aside: the process's own module stays
        assert sys.modules["own_model"] is caller_own_model
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [str(tmp_path / "a" / "audit.toml"), "--out", str(tmp_path / "out")]
    )
    assert cli.run(args) == 0
    out = capsys.readouterr().out
    assert "audit 'beside'" in out
    assert "membership loss-mia (AUC): none " in out
    assert f"report: {tmp_path / 'out' / 'report.md'}" in out
    args.quiet = True
    assert cli.run(args) == 0
    assert capsys.readouterr().out == ""
