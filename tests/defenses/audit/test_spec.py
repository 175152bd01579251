"""Audit specs and the ``defense-suite audit`` command function."""

import argparse
import json
import time
from pathlib import Path

import pytest

from defenses.audit import cli
from defenses.audit.spec import AuditSpecError, load_spec
from defenses.reference.defense import LabelOnly, Rounding
from defenses.ssd.arms import SSDDefense

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "benchmarks" / "audits").glob("*.toml"))

QUICK = """
name = "quick"
loader = "defenses.audit.examples:breast_cancer_mlp"
defenses = ["rounding", {name = "rounding", decimals = 3}]
seeds = [0]
per_target = 2
[loader_args]
members = 0.3
[threat]
access = "labels"
[shadows]
n_shadows = 2
[attacks.brep]
n_init = 64
n_dirs = 8
iterations = 3
"""


def test_example_specs_parse():
    assert {p.name for p in EXAMPLES} == {"breast-cancer-mlp.toml", "digits-cnn.toml"}
    for path in EXAMPLES:
        spec = load_spec(path)
        assert [type(d) for d in spec.defenses] == [Rounding, LabelOnly, SSDDefense]
        assert spec.config.seeds == (0, 1, 2)
        assert callable(spec.loader)


def test_command_writes_the_report(tmp_path):
    path = tmp_path / "quick.toml"
    path.write_text(QUICK)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([str(path), "--out", str(tmp_path / "out")])
    assert cli.run(args) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["name"] == "quick"
    assert report["data"]["arms"] == ["none", "rounding", "rounding(decimals=3)"]
    assert report["data"]["private_classes"] == ["0"]
    refused = {r["attack"] for r in report["refusals"]}
    assert refused == {"loss-mia", "confidence-mia", "lira-offline", "ssd-mirror"}
    page = (tmp_path / "out" / "report.md").read_text()
    assert "sees predicted labels only" in page.split("\n## Membership")[0]


BAD = [
    ("colour = 1\nloader = 'a:b'", "'colour'"),
    ("name = 'x'", "'loader'"),
    ("loader = 'no_colon'", "'loader'"),
    ("loader = 'no.such.module:f'", "'loader'"),
    ("loader = 'defenses.audit.examples:nothing'", "'loader'"),
    (
        "loader = 'defenses.audit.examples:digits_cnn'\ndefenses = ['no-such']",
        "'defenses[0]'",
    ),
    (
        "loader = 'defenses.audit.examples:digits_cnn'\n"
        "defenses = [{name = 'rounding', digits = 2}]",
        "'defenses[0]'",
    ),
    (
        "loader = 'defenses.audit.examples:digits_cnn'\n[threat]\naccess = 'weights'",
        "'threat'",
    ),
    (
        "loader = 'defenses.audit.examples:digits_cnn'\n[threat]\nbudget = 3",
        "'threat.budget'",
    ),
    (
        "loader = 'defenses.audit.examples:digits_cnn'\n[shadows]\nn_shadows = 1",
        "'shadows'",
    ),
    (
        "loader = 'defenses.audit.examples:digits_cnn'\n[attacks.gan]\nsteps = 1",
        "'attacks.gan'",
    ),
    ("loader = 'defenses.audit.examples:digits_cnn'\nseeds = 3", "'seeds'"),
    ("loader = 'defenses.audit.examples:digits_cnn'\nseeds = [-1]", "seeds"),
    ("loader = [", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "key"), BAD)
def test_bad_specs_name_file_and_key(tmp_path, text, key):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(AuditSpecError) as error:
        load_spec(path)
    message = str(error.value)
    assert str(path) in message
    assert key in message
    assert "\n" not in message


def test_loader_errors_name_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        "loader = 'defenses.audit.examples:breast_cancer_mlp'\n"
        "[loader_args]\nsize = 3\n"
    )
    with pytest.raises(AuditSpecError, match="'loader_args'"):
        load_spec(path).load()
    path.write_text(
        "loader = 'defenses.audit.examples:build_mlp'\n[loader_args]\nseed = 0\n"
    )
    with pytest.raises(AuditSpecError, match="AuditInputs"):
        load_spec(path).load()
    with pytest.raises(AuditSpecError, match="cannot read"):
        load_spec(tmp_path / "missing.toml")


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_audits_run_in_under_two_minutes(path, tmp_path):
    """Default settings, serial shadows: under two minutes of this process's CPU.

    The audit runs in one thread, so its CPU time is its wall time on a machine with
    a free core; on a shared machine the wall time also counts the waiting.
    """
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    start, cpu = time.perf_counter(), time.process_time()
    assert cli.run(parser.parse_args([str(path), "--out", str(tmp_path)])) == 0
    used, elapsed = time.process_time() - cpu, time.perf_counter() - start
    assert used < 120, f"{path.name} used {used:.0f} s CPU ({elapsed:.0f} s wall)"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["refusals"] == []
