"""The audit on the three kinds of model, with every kind of defense, and its report."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from defenses.audit import AuditConfig, audit
from defenses.audit.examples import DigitsCNN, build_cnn, build_mlp
from defenses.audit.shadows import ShadowConfig, fit_module
from defenses.data import load_digits
from defenses.reference.defense import LabelOnly, Rounding
from defenses.results import UNDEFENDED
from defenses.ssd import StealthyShield
from defenses.ssd.arms import SSDDefense

from .conftest import FAST

MEMBERSHIP = ("loss-mia", "confidence-mia", "label-only-mia")


def _successes(report):
    return {(r.attack, r.defense, r.seed): dict(r.success) for r in report.results}


def test_sklearn_callable_and_string_labels_agree(cancer):
    model, members, non_members = cancer
    base = audit(model, members, non_members, defenses=[Rounding()], config=FAST)
    as_callable = audit(
        model.predict_proba, members, non_members, defenses=[Rounding()], config=FAST
    )
    assert _successes(base) == _successes(as_callable)
    # a model fitted on string labels: the audit encodes them through classes_
    names = np.array(["benign", "malignant"])
    X, y = members
    named = build_mlp(0).fit(X, names[1 - y])
    report = audit(
        named,
        (X, names[1 - y]),
        (non_members[0], names[1 - non_members[1]]),
        private_class="malignant",
        config=FAST,
    )
    assert report.data["private_classes"] == ["malignant"]
    assert report.result("loss-mia", UNDEFENDED, 0).utility["accuracy"] > 0.8


@pytest.fixture(scope="module")
def cnn():
    data = load_digits()
    X = data.X.reshape(-1, 1, 8, 8)
    order = np.random.default_rng(0).permutation(len(data))
    members, non_members = order[:300], order[300:600]
    fit = ShadowConfig(epochs=5, batch_size=64, lr=3e-3)
    net = fit_module(build_cnn(0), X[members], data.y[members], fit, 0)
    return net, (X[members], data.y[members]), (X[non_members], data.y[non_members])


def test_torch_module_equals_its_softmax_callable(cnn):
    net, members, non_members = cnn

    def probs(x):
        with torch.no_grad():
            return torch.softmax(net(torch.as_tensor(x, dtype=torch.float32)), 1)

    report = audit(net, members, non_members, private_class=0, config=FAST)
    again = audit(
        lambda x: probs(x).double().numpy(),
        members,
        non_members,
        private_class=0,
        config=FAST,
    )
    ours, theirs = _successes(report), _successes(again)
    assert ours.keys() == theirs.keys()
    for key, values in ours.items():
        for metric, value in values.items():
            assert theirs[key][metric] == pytest.approx(value, abs=1e-6), key
    inversion = report.result("ssd-brep(n_init=64, n_dirs=8, iterations=3)", "none", 0)
    assert {"acc@1", "acc@2", "verified_rate", "feature_dist"} <= set(inversion.success)


def test_torch_shadows_train_through_lira(cnn):
    net, members, non_members = cnn
    config = dataclasses.replace(
        FAST, shadows=ShadowConfig(n_shadows=2, epochs=2, batch_size=64)
    )
    report = audit(net, members, non_members, build_model=DigitsCNN, config=config)
    lira = report.result("lira-offline", UNDEFENDED, 0)
    assert 0.0 <= lira.success["auc"] <= 1.0
    # 300 members + the 225 non-members left after a quarter of each class of the
    # non-members is held out to fit defenses on (no test= or validation= given)
    assert lira.cost["queries"] == 525
    assert report.data["validation"] == 75
    assert "carved from the non-members" in report.data["validation_source"]


def test_every_kind_of_defense_is_one_paired_arm(cancer):
    from art.defences.postprocessor import Rounded

    model, members, non_members = cancer
    report = audit(
        model,
        members,
        non_members,
        defenses=[
            Rounding(decimals=1),
            LabelOnly(),
            SSDDefense(epsilon=1.0),
            StealthyShield(epsilon=2.0),
            Rounded(decimals=2),
        ],
        config=FAST,
    )
    arms = report.data["arms"]
    assert arms == [
        "none",
        "rounding",
        "label-only",
        "ssd-shield(epsilon=1.0)",
        "ssd-shield(epsilon=2.0)",
        "art-Rounded(decimals=2)",
    ]
    for attack in MEMBERSHIP:
        for seed in FAST.seeds:
            clean = report.result(attack, UNDEFENDED, seed)
            assert clean.utility["l1_distortion"] == 0.0
            labels = report.result(attack, "label-only", seed)
            assert labels.utility["accuracy"] == clean.utility["accuracy"]
            assert labels.utility["l1_distortion"] > 0
            ssd = report.result(attack, "ssd-shield(epsilon=2.0)", seed)
            assert ssd.utility["l1_distortion"] > 0
    # label-only answers give the loss attack nothing beyond the label attack
    assert (
        report.result("loss-mia", "label-only", 0).success["auc"]
        == report.result("label-only-mia", UNDEFENDED, 0).success["auc"]
    )
    with pytest.raises(ValueError, match="same arm twice"):
        audit(model, members, non_members, defenses=[LabelOnly(), LabelOnly()])
    with pytest.raises(TypeError, match="defenses"):
        audit(model, members, non_members, defenses=[object()])


def test_same_seeds_same_report(cancer):
    model, members, non_members = cancer
    one = audit(model, members, non_members, defenses=[SSDDefense()], config=FAST)
    two = audit(model, members, non_members, defenses=[SSDDefense()], config=FAST)
    assert _successes(one) == _successes(two)


def test_report_markdown_json_and_files(cancer, tmp_path):
    model, members, non_members = cancer
    report = audit(
        model,
        members,
        non_members,
        defenses=[Rounding()],
        private_class=1,
        build_model=build_mlp,
        config=dataclasses.replace(FAST, seeds=(0, 1)),
        name="cancer",
    )
    assert report.refusals == ()
    assert {r.attack.split("(")[0] for r in report.results} == {
        *MEMBERSHIP,
        "lira-offline",
        "ssd-brep",
        "ssd-mirror",
    }
    text = report.to_markdown()
    assert text.startswith("# Privacy audit: cancer\n\n**Verdict.** Membership")
    assert "## Glossary" in text
    assert "**Threat model.**" in text
    assert "## Membership inference" in text
    assert "## Model inversion of the private classes" in text
    assert "Paired deltas" in text
    data = json.loads(report.to_json())
    assert data["threat"] == report.threat.to_dict()
    assert len(data["results"]) == len(report.results) == 6 * 2 * 2
    assert {c["attack"] for c in data["roc"]} == {*MEMBERSHIP, "lira-offline"}
    for curve in data["roc"]:
        assert curve["fpr"][0] == 0.0
        assert curve["tpr"][-1] == 1.0
    written = report.write(tmp_path / "out")
    assert set(written) == {"roc", "tradeoff", "markdown", "json", "results"}
    for path in written.values():
        assert path.stat().st_size > 0
    page = written["markdown"].read_text()
    assert "![ROC of the membership attacks (log-log)](roc.png)" in page
    lines = written["results"].read_text().splitlines()
    assert len(lines) == len(report.results)


def test_config_is_checked():
    with pytest.raises(ValueError, match=r"AuditConfig\.seeds"):
        AuditConfig(seeds=())
    with pytest.raises(ValueError, match=r"AuditConfig\.delta"):
        AuditConfig(delta=1.0)
    with pytest.raises(ValueError, match=r"ShadowConfig\.n_shadows"):
        ShadowConfig(n_shadows=1)
    with pytest.raises(ValueError, match=r"ShadowConfig\.executor"):
        ShadowConfig(executor="threads")
