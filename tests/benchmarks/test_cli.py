import json
import logging
import sys
from pathlib import Path

import pytest

from defense_suite.cli import build_parser, main
from defenses.results import read_jsonl
from tests.benchmarks.records import auc_record

REPO = Path(__file__).resolve().parents[2]

SPEC = """
title = "mini"
claim = "rounding lowers AUC"
scenario = "digits-membership"
attacks = ["loss-mia"]
defenses = ["none", "label-only"]
seeds = [0, 1]

[report]
columns = ["utility.accuracy", "success.auc"]
x = "utility.accuracy"
y = "success.auc"

[report.summary]
threat = "membership"
attack = "loss-mia"
defense = "label-only"
metric = "success.auc"
paper = "AUC falls"
relative_change = 0.01
"""

RECORD = auc_record().to_dict()


def test_run_table_plot_report_end_to_end(tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "mini-quick.toml").write_text(SPEC)
    results = tmp_path / "results"
    out = results / "mini-quick.jsonl"
    assert main(["run", str(specs / "mini-quick.toml"), "--out", str(out)]) == 0
    runs = read_jsonl(out)
    assert {(r.seed, r.defense) for r in runs} == {
        (0, "none"),
        (0, "label-only"),
        (1, "none"),
        (1, "label-only"),
    }
    assert all(r.meta["spec"] == "mini-quick" for r in runs)

    assert main(["table", str(out), "--delta", "--cols", "success.auc"]) == 0
    table = capsys.readouterr().out
    assert "| digits-membership | loss-mia | label-only | 2 |" in table

    png = tmp_path / "p.png"
    args = ["plot", str(out), "--x", "utility.accuracy", "--y", "success.auc"]
    assert main([*args, "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"

    readme = tmp_path / "README.md"
    original = "x\n<!-- results:start -->\nold\n<!-- results:end -->\ny\n"
    readme.write_text(original)
    args = ["report", "--results", str(results), "--specs", str(specs)]
    assert main(args) == 0
    assert readme.read_text() == original  # the report alone never touches a README
    report = (results / "REPORT.md").read_text()
    assert "**Paper's claim:** rounding lowers AUC" in report
    assert "Paired deltas" in report
    assert "## Summary" in report
    assert "How to read the summary:" in report  # a glossary under the table
    assert "- **paired Δ**: defended minus baseline" in report
    assert "| membership | loss-mia | AUC falls | success.auc |" in report
    assert (results / "plots" / "mini-quick.png").exists()
    assert (results / "plots" / "mini-quick-delta.png").read_bytes()[:4] == b"\x89PNG"
    assert "plots/mini-quick-delta.png" in report
    (tmp_path / "plain.md").write_text("no block\n")
    assert main([*args, "--readme", str(tmp_path / "plain.md")]) == 2
    assert "no results block" in capsys.readouterr().err
    assert main([*args, "--readme", str(readme)]) == 0
    assert "old" not in readme.read_text()
    assert "AUC falls" in readme.read_text()


def test_security_report_is_per_arm_and_names_the_enforcing_party(tmp_path, capsys):
    results = tmp_path / "results"
    spec = tmp_path / "mini-quick.toml"
    spec.write_text(
        SPEC.replace('["none", "label-only"]', '["none", "rounding"]')
        + "\n[params.defense.rounding]\ndecimals = [2, 3]\n"
    )
    out = str(results / "m.jsonl")
    assert main(["run", str(spec), "--out", out, "--seeds", "0", "1"]) == 0
    capsys.readouterr()
    assert main(["report", "--results", str(results), "--system", "rounding"]) == 0
    text = capsys.readouterr().out
    assert "# Security report: `rounding`" in text
    assert "- reference: the model owner's output layer" in text
    assert "capabilities: query-label, query-scores" in text
    assert "## Arm `rounding(decimals=2)` on digits-membership" in text
    assert "## Arm `rounding(decimals=3)` on digits-membership" in text
    args = ["report", "--results", str(results), "--system", "rounding", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert [arm["defense"] for arm in report["arms"]] == [
        "rounding(decimals=2)",
        "rounding(decimals=3)",
    ]
    runs = read_jsonl(out)
    for arm in report["arms"]:  # each arm's numbers are its own, not a pooled mean
        mine = [r.success["auc"] for r in runs if r.defense == arm["defense"]]
        assert arm["defended"]["auc"]["n"] == 2
        assert arm["defended"]["auc"]["mean"] == pytest.approx(sum(mine) / 2)
        assert arm["undefended"]["auc"]["n"] == 2
    assert main(["report", "--results", str(results), "--system", "ssd"]) == 2


def _error(capsys, argv):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("defense-suite")
    assert "error:" in lines[0]
    assert "Traceback" not in captured.err
    return lines[0]


def _record_file(tmp_path, **change):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({**RECORD, **change}) + "\n")
    return str(path)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"success": {"auc": float("inf")}}, "metrics must be finite"),
        ({"utility": [1, 2]}, "Result.utility must be a mapping"),
        ({"params": None}, "Result.params must be a mapping"),
        ({"seed": "zero"}, "Result.seed must be an integer"),
    ],
)
@pytest.mark.parametrize("command", ["table", "plot"])
def test_malformed_records_are_one_error_line(
    tmp_path, capsys, change, expected, command
):
    path = _record_file(tmp_path, **change)
    argv = [command, path]
    if command == "plot":
        argv += ["--x", "utility.accuracy", "--y", "success.auc", "--out", "p.png"]
    line = _error(capsys, argv)
    assert f"{path}:1" in line
    assert expected in line


def test_user_errors_are_one_line_naming_the_file_key_or_flag(tmp_path, capsys):
    good = _record_file(tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    spec = tmp_path / "mini-quick.toml"
    spec.write_text(SPEC)
    out = str(tmp_path / "o.jsonl")
    assert "is a directory" in _error(capsys, ["run", str(folder), "--out", out])
    assert "--out" in _error(capsys, ["run", str(spec), "--out", str(folder)])
    assert "is a directory" in _error(capsys, ["table", str(folder)])
    line = _error(capsys, ["table", str(tmp_path / "missing.jsonl")])
    assert "missing.jsonl" in line
    line = _error(capsys, ["run", str(spec), "--out", out, "--seeds", "-1"])
    assert "--seeds" in line
    lots = tmp_path / "lots-quick.toml"
    lots.write_text(SPEC + '\n[params.scenario]\nmembers = "lots"\n')
    line = _error(capsys, ["run", str(lots), "--out", out])
    assert str(lots) in line
    assert "[params.scenario]" in line
    assert "members" in line
    unknown = tmp_path / "unknown-quick.toml"
    unknown.write_text(SPEC.replace('"loss-mia"]', '"no-such-attack"]', 1))
    assert "no-such-attack" in _error(capsys, ["run", str(unknown), "--out", out])
    line = _error(capsys, ["table", good, "--cols", "success.acc1"])
    assert "'success.acc1'" in line
    assert "metrics present: utility.accuracy, success.auc" in line
    png = tmp_path / "p.png"
    argv = ["plot", good, "--x", "utility.accuracy", "--y", "success.acc1"]
    line = _error(capsys, [*argv, "--out", str(png)])
    assert "--y" in line
    assert "success.auc" in line
    assert not png.exists()
    line = _error(capsys, ["report", "--results", str(tmp_path / "empty")])
    assert "--results" in line
    assert "--seeds" in _error(capsys, ["run", str(spec), "--out", out, "--seeds", "x"])
    assert not Path(out).exists()


def test_unknown_key_in_a_spec_is_named(tmp_path, capsys):
    bad = tmp_path / "bad-quick.toml"
    bad.write_text('title = "x"\nscenario = "s"\nattacks = ["a"]\nfoo = 1\n')
    line = _error(capsys, ["run", str(bad), "--out", str(tmp_path / "o.jsonl")])
    assert "unknown key(s) ['foo']" in line


def test_help_is_plain_text(capsys):
    parser = build_parser()
    texts = [parser.format_help()]
    texts += [
        p.format_help() for p in parser._subparsers._group_actions[0].choices.values()
    ]
    for text in texts:
        for markup in ("``", ":func:", ":class:", ":math:", "\n.. "):
            assert markup not in text


def test_run_logs_one_line_per_arm_and_seed_off_a_terminal(tmp_path, capsys, caplog):
    spec = tmp_path / "mini-quick.toml"
    spec.write_text(SPEC)
    assert not sys.stderr.isatty()  # as in CI or a log file
    assert main(["run", str(spec), "--out", str(tmp_path / "o.jsonl")]) == 0
    assert logging.getLogger("defense_suite").getEffectiveLevel() == logging.INFO
    progress = [
        r.getMessage()
        for r in caplog.records
        if r.name == "defense_suite.runner" and " done in " in r.getMessage()
    ]
    assert len(progress) == 4, caplog.text
    assert progress[0].startswith("[1/4] digits-membership / loss-mia / none seed=0")
    assert progress[-1].startswith("[4/4] digits-membership / loss-mia / label-only")
    assert "\r" not in capsys.readouterr().err  # no progress bar


def test_list_components_shows_registered_components(capsys):
    assert main(["list", "--components"]) == 0
    listing = capsys.readouterr().out
    assert "  digits-membership\n" in listing
    assert "  loss-mia\n" in listing
    assert "ssd-quick" not in listing  # the specs are plain `list`'s


def test_bench_writes_only_under_results(tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "mini-quick.toml").write_text(SPEC.replace("[0, 1]", "[0]"))
    (specs / "mini-full.toml").write_text(SPEC)
    results = tmp_path / "results"
    readme = REPO / "README.md"
    before = readme.read_bytes()
    args = ["bench", "--specs", str(specs), "--results", str(results), "--jobs", "1"]
    assert main(args) == 0
    assert readme.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results", "specs"]
    assert sorted(p.name for p in results.iterdir()) == [
        "REPORT.md",
        "bench-times.json",
        "mini-quick.jsonl",
        "plots",
    ]
    assert len(read_jsonl(results / "mini-quick.jsonl")) == 2
    first = (results / "mini-quick.jsonl").read_bytes()
    assert main([*args, "--resume"]) == 0
    assert (results / "mini-quick.jsonl").read_bytes() == first


def test_every_registered_defense_has_a_party_that_enforces_it():
    from defense_suite.security import ENFORCED_BY, package_of
    from defenses.registry import available, load

    missing = {}
    for name in available("defenses"):
        if load("defenses", name).__module__.startswith("tests."):
            continue
        record = RECORD | {"defense": name, "meta": {"spec": "x-quick"}}
        package = package_of(read_record(record))
        if package not in ENFORCED_BY:
            missing[name] = package
    assert missing == {}


def read_record(data):
    from defenses.results import Result

    return Result.from_dict(data)


def test_audit_command_reports_a_bad_spec_as_one_line(tmp_path, capsys):
    spec = tmp_path / "audit.toml"
    spec.write_text('name = "x"\n[model]\nloader = "no_such_module:load"\n')
    assert main(["audit", str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("defense-suite: error:")
    assert "audit.toml" in err[0]
    assert not (tmp_path / "out").exists()


def test_federated_run_refuses_a_folder_without_an_app(tmp_path, capsys):
    assert main(["federated", "run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pyproject.toml" in err
    assert "Traceback" not in err
