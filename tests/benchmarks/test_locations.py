"""Specs are named as a user expects: a path or a shipped spec's name, anywhere."""

from pathlib import Path

import pytest

from defense_suite.cli import main
from defense_suite.locations import audit_dir, resolve_spec, spec_dir
from defenses.results import read_jsonl

REPO = Path(__file__).resolve().parents[2]

MINI = """
scenario = "digits-membership"
attacks = ["loss-mia"]
defenses = ["none"]
seeds = [0]
"""


def test_a_bare_name_is_the_shipped_spec_with_or_without_toml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = spec_dir() / "ssd-quick.toml"
    assert resolve_spec("ssd-quick", spec_dir()) == expected
    assert resolve_spec("ssd-quick.toml", spec_dir()) == expected


def test_a_file_of_that_name_here_wins_over_the_shipped_spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ssd-quick").write_text(MINI)
    assert resolve_spec("ssd-quick", spec_dir()) == Path("ssd-quick")


def test_unknown_names_and_paths_are_refused_with_close_matches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"did you mean ssd-quick") as caught:
        resolve_spec("ssd-quik", spec_dir())
    assert str(caught.value).startswith("spec ssd-quik: no such file")
    with pytest.raises(ValueError, match=r"^spec sub/ssd-quick: no such file$"):
        resolve_spec("sub/ssd-quick", spec_dir())  # a path is never a name
    with pytest.raises(ValueError, match="is a directory"):
        resolve_spec(str(tmp_path), spec_dir())


def test_run_by_name_from_another_folder(tmp_path, monkeypatch, capsys):
    shipped = tmp_path / "shipped"  # stands for the wheel's spec folder
    shipped.mkdir()
    (shipped / "mini-quick.toml").write_text(MINI)
    monkeypatch.setattr("defense_suite.cli.spec_dir", lambda: shipped)
    here = tmp_path / "elsewhere"
    here.mkdir()
    monkeypatch.chdir(here)
    out = here / "mini.jsonl"
    assert main(["run", "mini-quick", "--out", str(out)]) == 0
    runs = read_jsonl(out)
    assert [(r.meta["spec"], r.defense) for r in runs] == [("mini-quick", "none")]


def test_run_with_a_misspelt_name_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["run", "reference-quik", "--out", str(tmp_path / "x.jsonl")])
    assert code == 2
    err = capsys.readouterr().err
    assert "did you mean reference-quick" in err
    assert not (tmp_path / "x.jsonl").exists()


def test_the_example_audits_are_found_and_shipped():
    assert audit_dir() == REPO / "benchmarks" / "audits"
    assert (audit_dir() / "digits-cnn.toml").is_file()
    assert resolve_spec("digits-cnn", audit_dir(), "audit spec").name == (
        "digits-cnn.toml"
    )
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"benchmarks/audits" = "defense_suite/audits"' in pyproject
