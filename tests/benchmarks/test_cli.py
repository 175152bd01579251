import json
from pathlib import Path

from benchmarks.cli import main
from defenses.results import read_jsonl

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
    assert (
        main(
            [
                "plot",
                str(out),
                "--x",
                "utility.accuracy",
                "--y",
                "success.auc",
                "--out",
                str(png),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:4] == b"\x89PNG"

    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- results:start -->\nold\n<!-- results:end -->\ny\n")
    args = [
        "report",
        "--results",
        str(results),
        "--specs",
        str(specs),
        "--readme",
        str(readme),
    ]
    assert main(args) == 0
    report = (results / "REPORT.md").read_text()
    assert "**Paper's claim:** rounding lowers AUC" in report
    assert "Paired deltas" in report
    assert "## Summary" in report
    assert "| membership | loss-mia | AUC falls | success.auc |" in report
    assert (results / "plots" / "mini-quick.png").exists()
    assert (results / "plots" / "mini-quick-delta.png").read_bytes()[:4] == b"\x89PNG"
    assert "plots/mini-quick-delta.png" in report
    assert "old" not in readme.read_text()
    assert "AUC falls" in readme.read_text()


def test_security_report_of_one_system(tmp_path, capsys):
    results = tmp_path / "results"
    spec = tmp_path / "mini-quick.toml"
    spec.write_text(SPEC)
    assert (
        main(["run", str(spec), "--out", str(results / "m.jsonl"), "--seeds", "0"]) == 0
    )
    capsys.readouterr()
    assert main(["report", "--results", str(results), "--system", "label-only"]) == 0
    text = capsys.readouterr().out
    assert "# Security report: `label-only`" in text
    assert "capabilities: query-label, query-scores" in text
    assert "| digits-membership | loss-mia | auc |" in text
    args = ["report", "--results", str(results), "--system", "label-only", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["attacks"][0]["undefended"]["auc"]["n"] == 1
    assert main(["report", "--results", str(results), "--system", "ssd"]) == 2


def test_errors_are_reported_not_raised(tmp_path, capsys):
    bad = tmp_path / "bad-quick.toml"
    bad.write_text('title = "x"\nscenario = "s"\nattacks = ["a"]\nfoo = 1\n')
    assert main(["run", str(bad), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "unknown key(s) ['foo']" in capsys.readouterr().err
    assert main(["report", "--results", str(tmp_path / "empty")]) == 1


def test_list_shows_registered_components(capsys):
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    assert "digits-membership" in listing
    assert "loss-mia" in listing


def test_python_dash_m_entry_point_exists():
    assert Path("benchmarks/__main__.py").exists()
