"""The basics of a mature command line: --version, --quiet/--verbose, a fast --help."""

import importlib
import json
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import defense_suite
import defenses
from defense_suite.cli import build_parser, main
from tests.benchmarks.records import auc_record

REPO = Path(__file__).resolve().parents[2]

RECORD = auc_record(spec="mini-quick").to_dict()


def test_version_flag_and_both_packages_agree_with_the_metadata(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"defense-suite {defense_suite.__version__}\n"
    assert defense_suite.__version__ == defenses.__version__
    for package in ("defense_suite.crypto", "defense_suite.federated"):
        assert importlib.import_module(package).__version__ == defenses.__version__
    assert version("defense-suite") == defenses.__version__
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    # static, because Flower's `flwr run` refuses a dynamic version
    assert project["project"]["version"] == defenses.__version__


def _report_args(tmp_path, *flags):
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    (results / "mini-quick.jsonl").write_text(json.dumps(RECORD) + "\n")
    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    (specs / "mini-quick.toml").write_text('scenario = "s"\nattacks = ["a"]\n')
    return [*flags, "report", "--results", str(results), "--specs", str(specs)]


def test_quiet_prints_nothing_and_the_default_says_what_it_wrote(tmp_path, capsys):
    assert main(_report_args(tmp_path, "--quiet")) == 0
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")
    assert (tmp_path / "results" / "REPORT.md").is_file()
    assert main(_report_args(tmp_path)) == 0
    assert capsys.readouterr().out.startswith("wrote ")


def test_quiet_and_verbose_exclude_each_other(capsys):
    assert main(["-q", "-v", "list"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_help_imports_neither_torch_nor_the_audit():
    """--help stays fast because it imports nothing heavy (timed in
    benchmarks/startup.py, not here)."""
    code = (
        "import sys, contextlib, io\n"
        "from defense_suite.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0\n"
        "heavy = ['torch', 'sklearn', 'defenses.audit', 'defenses.harness', 'tqdm']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_audit_sub_command_keeps_its_arguments(capsys):
    assert main(["audit", "--help"]) == 0
    assert "--out" in capsys.readouterr().out
    full = build_parser()
    lean = build_parser(audit=False)
    assert full.format_help() == lean.format_help()  # same top-level help


def test_license_changelog_and_citation_ship_with_the_checkout():
    import yaml

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "MIT"}
    assert (REPO / "LICENSE").read_text().startswith("MIT License\n")
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert f"## [{defenses.__version__}]" in changelog
    citation = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0"
    assert citation["version"] == defenses.__version__
    assert citation["license"] == "MIT"
    papers = citation["references"]
    assert len(papers) == 6
    assert all(p["year"] == 2025 and "ICLR" in p["conference"]["name"] for p in papers)
    assert all(p["authors"] and p["title"].strip() for p in papers)


def test_the_version_is_a_released_section_and_the_metadata_has_urls():
    import re

    changelog = (REPO / "CHANGELOG.md").read_text()
    released = re.search(
        rf"^## \[{re.escape(defenses.__version__)}\] - (\d{{4}}-\d\d-\d\d)$",
        changelog,
        re.M,
    )
    assert released is not None  # the installed version is a dated release
    unreleased = changelog.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    assert "\n- " not in unreleased  # nothing of this version is left unreleased
    urls = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]
    assert urls
    assert all(url.startswith("https://") for url in urls.values())
