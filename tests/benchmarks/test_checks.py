"""Specs and paths are checked: a bad value is refused with its key or path."""

import dataclasses
import functools
import json
import math
import tempfile
from pathlib import Path

import pytest

from defense_suite.cli import main
from defense_suite.report import write_report
from defense_suite.spec import SpecError, SummarySettings, parse
from defense_suite.summary import markdown_summary, summary_row
from defense_suite.tables import markdown_table, show
from defenses.results import describe
from tests.benchmarks.records import auc_record

GAME = {"scenario": "digits-membership", "attacks": ["loss-mia"], "seeds": [0, 1]}
SUMMARY = {"threat": "t", "metric": "success.auc", "defense": "rounding"}


_record = functools.partial(auc_record, spec="mini-quick")


def _write(path, records):
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("report", "message"),
    [
        ({"delta": "no"}, r"report\.delta must be true or false, got 'no'"),
        ({"delta": 0}, r"report\.delta must be true or false, got 0"),
        ({"notes": 3}, r"report\.notes must be a string, got 3"),
        ({"columns": ["auc"]}, r"report\.columns must be a metric path"),
        ({"columns": ["score.auc"]}, r"section one of \('utility'"),
        ({"columns": ["success."]}, r"got 'success\.'"),
        ({"columns": ["success.auc"] * 2}, r"must not repeat a metric"),
        ({"x": "utility.accuracy"}, r"give both 'x' and 'y'"),
        ({"x": "accuracy", "y": "success.auc"}, r"report\.x must be a metric path"),
    ],
)
def test_report_values_are_type_and_range_checked(report, message):
    with pytest.raises(SpecError, match=message):
        parse({**GAME, "report": report}, "bad")


@pytest.mark.parametrize("key", ["attacks", "defenses"])
def test_a_repeated_attack_or_defense_is_refused(key):
    with pytest.raises(SpecError, match=rf"{key} must not repeat a name"):
        parse({**GAME, key: ["loss-mia", "loss-mia"]}, "bad")


@pytest.mark.parametrize(
    ("summary", "message"),
    [
        ({"relative_change": math.inf}, r"relative_change must be a finite number"),
        ({"relative_change": math.nan}, r"relative_change must be a finite number"),
        ({"relative_change": -0.1}, r"relative_change must be a finite number"),
        ({"relative_change": True}, r"relative_change must be a number"),
        ({"metric": "auc"}, r"summary\.metric must be a metric path"),
        ({"utility": "accuracy"}, r"summary\.utility must be a metric path"),
        ({"threat": "  "}, r"summary\.threat must not be empty"),
        ({"direction": "down"}, r"direction must be one of"),
        ({"basis": "guessed"}, r"basis must be one of \('measured', 'projected'\)"),
        ({"basis": "projected"}, r"measured_range is required"),
        ({"measured_range": "d = 2..5"}, r"belong to basis = 'projected'"),
        ({"interval": ["cost.a", "cost.b"]}, r"belong to basis = 'projected'"),
        (
            {"basis": "projected", "measured_range": "d", "interval": ["cost.a"]},
            r"interval must be two metric paths",
        ),
        (
            {"basis": "projected", "measured_range": "d", "interval": ["a", "b"]},
            r"interval must be a metric path",
        ),
    ],
)
def test_summary_values_are_type_and_range_checked(summary, message):
    with pytest.raises(SpecError, match=message) as caught:
        parse({**GAME, "report": {"summary": {**SUMMARY, **summary}}}, "bad")
    assert str(caught.value).startswith("spec 'bad': report.summary")


def test_a_column_no_result_reports_is_refused_at_report_time(tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "mini-quick.toml").write_text(
        'scenario = "s"\nattacks = ["a"]\n[report]\n'
        'columns = ["success.auc", "success.acu"]\n'
    )
    results = _write(tmp_path / "mini-quick.jsonl", [_record("none", 0.7)])
    with pytest.raises(ValueError, match=r"report\.columns: no result reports the "):
        write_report([results], specs, tmp_path / "REPORT.md")
    assert not (tmp_path / "REPORT.md").exists()


def test_report_refuses_a_missing_or_empty_spec_folder(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    _write(results / "mini-quick.jsonl", [_record("none", 0.7)])
    missing = tmp_path / "no-such-specs"
    assert main(["report", "--results", str(results), "--specs", str(missing)]) == 2
    assert f"--specs {missing}: no such folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", "--results", str(results), "--specs", str(empty)]) == 2
    assert "no spec files (*.toml)" in capsys.readouterr().err
    assert not (results / "REPORT.md").exists()


def _unwritable_folder():
    try:
        with tempfile.TemporaryFile(dir="/sys"):
            pass
    except OSError:
        return Path("/sys")
    pytest.skip("/sys is writable here: no unwritable folder to test with")


def test_an_unwritable_out_is_refused_naming_the_path_given(tmp_path, capsys):
    folder = _unwritable_folder()
    given = folder / "results.jsonl"
    code = main(["run", "reference-quick", "--out", str(given)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--out {given}: cannot write in {folder}" in err
    assert ".tmp" not in err
    nested = folder / "new" / "deeper" / "r.jsonl"
    assert main(["run", "reference-quick", "--out", str(nested)]) == 2
    assert f"--out {nested}: cannot write in {folder}" in capsys.readouterr().err


def test_an_out_below_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    given = tmp_path / "file" / "r.jsonl"
    assert main(["run", "reference-quick", "--out", str(given)]) == 2
    assert f"--out {given}: {tmp_path / 'file'} is a file" in capsys.readouterr().err


def test_a_binary_results_file_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps(_record("none", 0.7).to_dict())
    bad.write_bytes(good.encode() + b"\n\x89PNG\r\n")
    assert main(["table", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: not UTF-8 text (byte 0x89 at column 1)" in err


def test_a_non_json_results_file_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    assert main(["table", str(bad)]) == 2
    assert f"{bad}:1: not a result record" in capsys.readouterr().err


def test_deterministic_results_print_without_a_zero_spread():
    assert show(describe([0.9, 0.9, 0.9])) == "0.900"
    assert show(describe([0.5])) == "0.500"
    assert show(describe([0.8, 0.9])) == "0.850 ± 0.071"
    runs = [
        _record("none", 0.7, seed=0),
        _record("none", 0.7, seed=1),
        _record("rounding", 0.6, seed=0, accuracy=0.8),
        _record("rounding", 0.65, seed=1, accuracy=0.8),
    ]
    table = markdown_table(runs, ["utility.accuracy", "success.auc"])
    assert "± 0.000" not in table
    assert "| 0.900 | 0.700 |" in table
    assert "| 0.800 | 0.625 ± 0.035 |" in table


def _spec(summary):
    return parse({**GAME, "report": {"summary": {**SUMMARY, **summary}}}, "mini-quick")


RUNS = [_record("none", 0.8, seed=0), _record("rounding", 0.4, seed=0)]


def test_a_projected_row_is_never_reproduced_and_states_the_measured_range():
    spec = _spec(
        {"basis": "projected", "measured_range": "d = 2..5", "relative_change": 0.1}
    )
    row = summary_row(spec, RUNS)
    assert row.verdict == "projected"
    assert row.note == "measured d = 2..5; the projection alone: reproduced"
    table = markdown_summary([row], ["success.auc"])
    assert (
        "| **projected** (measured d = 2..5; the projection alone: reproduced) |"
        in (table)
    )
    assert "**reproduced**" not in table


def test_a_measured_row_keeps_its_verdict_and_has_no_note():
    row = summary_row(_spec({"relative_change": 0.1}), RUNS)
    assert (row.verdict, row.note) == ("reproduced", "")
    failed = summary_row(_spec({"relative_change": 0.1, "direction": "higher"}), RUNS)
    assert failed.verdict == "not reproduced"


def test_summary_settings_built_in_code_are_checked_too():
    with pytest.raises(SpecError, match="finite"):
        SummarySettings(threat="t", metric="success.auc", defense="d",
                        relative_change=float("inf"))  # fmt: skip


def test_every_shipped_row_resting_on_a_projection_says_so():
    """Only the HE sweep's rows project beyond what was measured (checked by hand:
    their metric is cost.projected_*); every such row must be basis = 'projected'."""
    from defense_suite.locations import spec_dir
    from defense_suite.spec import load_spec

    for path in sorted(spec_dir().glob("*.toml")):
        summary = load_spec(path).report.summary
        if summary is None:
            continue
        rests_on_projection = "projected" in summary.metric
        assert (summary.basis == "projected") == rests_on_projection, path.name


def test_a_projected_row_states_its_interval_from_the_defended_runs():
    spec = _spec(
        {
            "basis": "projected",
            "measured_range": "d = 2..5",
            "interval": ["utility.low", "utility.high"],
            "relative_change": 0.1,
        }
    )
    runs = [
        _record("none", 0.8),
        dataclasses.replace(
            _record("rounding", 0.4), utility={"low": 7.125, "high": 8.5}
        ),
    ]
    row = summary_row(spec, runs)
    assert row.note == (
        "measured d = 2..5; interval low .. high = 7.12 .. 8.5; the projection "
        "alone: reproduced"
    )
