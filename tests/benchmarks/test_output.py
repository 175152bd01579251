"""Results files survive failures: atomic writes, --resume, --append, Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.benchmarks.plugin  # noqa: F401  (registers the test components)
from defense_suite.cli import main
from defense_suite.runner import record_key
from defenses.results import read_jsonl

REPO = Path(__file__).resolve().parents[2]

SPEC = """
scenario = "digits-membership"
attacks = ["loss-mia"]
defenses = ["none", "label-only"]
seeds = [0, 1]
"""


def _spec(tmp_path, text=SPEC, name="mini-quick.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_a_bad_spec_leaves_the_results_file_alone(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text("sentinel\n")
    bad = _spec(tmp_path, SPEC + '[params.scenario]\nmembers = "lots"\n')
    assert main(["run", str(bad), "--out", str(out)]) == 2
    assert main(["run", str(_spec(tmp_path)), "--out", str(out), "--seeds", "-1"]) == 2
    assert out.read_text() == "sentinel\n"
    assert _leftovers(tmp_path) == []


def test_a_run_that_fails_midway_leaves_the_file_as_it_was(tmp_path):
    out = tmp_path / "r.jsonl"
    assert main(["run", str(_spec(tmp_path)), "--out", str(out), "--seeds", "0"]) == 0
    before = out.read_bytes()
    failing = _spec(
        tmp_path,
        SPEC.replace('["none", "label-only"]', '["none", "failing-defense"]'),
        "failing-quick.toml",
    )
    with pytest.raises(RuntimeError, match="fails while fitting"):
        main(["run", str(failing), "--out", str(out)])
    assert out.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_resume_skips_the_records_already_there(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    spec = str(_spec(tmp_path))
    assert main(["run", spec, "--out", str(out), "--seeds", "0"]) == 0
    first = read_jsonl(out)
    assert len(first) == 2
    assert main(["run", spec, "--out", str(out), "--resume"]) == 0
    assert "wrote 2 results" in capsys.readouterr().out
    runs = read_jsonl(out)
    assert [r.to_dict() for r in runs[:2]] == [r.to_dict() for r in first]
    assert sorted((r.seed, r.defense) for r in runs) == [
        (0, "label-only"),
        (0, "none"),
        (1, "label-only"),
        (1, "none"),
    ]
    assert main(["run", spec, "--out", str(out), "--resume"]) == 0
    assert "wrote 0 results" in capsys.readouterr().out
    assert len(read_jsonl(out)) == 4


def test_append_never_writes_a_key_twice(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    spec = str(_spec(tmp_path))
    assert main(["run", spec, "--out", str(out), "--seeds", "0"]) == 0
    before = out.read_bytes()
    assert main(["run", spec, "--out", str(out), "--append"]) == 2
    err = capsys.readouterr().err
    assert "--append" in err
    assert "already holds 2 of this run's records" in err
    assert "--resume" in err
    assert out.read_bytes() == before
    assert main(["run", spec, "--out", str(out), "--append", "--seeds", "1"]) == 0
    keys = [record_key(r) for r in read_jsonl(out)]
    assert len(keys) == len(set(keys)) == 4


def test_an_overwrite_replaces_the_file(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text("")
    spec = str(_spec(tmp_path))
    assert main(["run", spec, "--out", str(out), "--seeds", "0"]) == 0
    assert main(["run", spec, "--out", str(out), "--seeds", "1"]) == 0
    assert {r.seed for r in read_jsonl(out)} == {1}


def test_ctrl_c_aborts_and_records_nothing_of_the_interrupted_arm(tmp_path):
    """SIGINT during scikit-learn's MLP fit, which swallows KeyboardInterrupt."""
    out = tmp_path / "r.jsonl"
    out.write_text("")
    fits = tmp_path / "fits.log"
    spec = _spec(
        tmp_path,
        SPEC.replace("digits-membership", "slow-digits-membership").replace(
            "[0, 1]", "[0]"
        ),
        "slow-quick.toml",
    )
    # the game needs only the reference package and the plugin: skip discovering
    # (importing) every other package, which only slows the subprocess down
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import tests.benchmarks.plugin, defenses.registry as registry; "
        "registry._discovered = True; from defense_suite.cli import main; "
        "raise SystemExit(main(sys.argv[2:]))"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(REPO), "run", str(spec), "--out", str(out)],
        cwd=tmp_path,
        env={
            **os.environ,
            "DEFENSE_SUITE_TEST_FITS": str(fits),
            "OMP_NUM_THREADS": "1",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (
        not fits.exists() or len(fits.read_text().splitlines()) < 2
    ):
        assert process.poll() is None, process.communicate()
        time.sleep(0.1)
    time.sleep(2.5)  # well inside the second (slow) MLP fit
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Training interrupted by user" in err  # the library swallowed it ...
    assert "interrupted" in err.splitlines()[-1]  # ... and the run still stopped
    assert out.read_text() == ""  # the first, finished arm is not written either
    assert _leftovers(tmp_path) == []


def test_stale_temporary_files_of_dead_processes_are_removed(tmp_path):
    out = tmp_path / "r.jsonl"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f".r.jsonl.{int(dead.stdout)}.tmp"
    stale.write_text(json.dumps({"half": "written"}))
    assert main(["run", str(_spec(tmp_path)), "--out", str(out), "--seeds", "0"]) == 0
    assert not stale.exists()
    assert len(read_jsonl(out)) == 2


def test_measurement_specs_never_duplicate_a_key(tmp_path):
    spec = _spec(
        tmp_path,
        'benchmark = "test-counter"\nseeds = [0, 1]\n[params.benchmark]\nn = [1, 2]\n',
        "counter-quick.toml",
    )
    out = tmp_path / "r.jsonl"
    assert main(["run", str(spec), "--out", str(out), "--seeds", "0"]) == 0
    assert len(read_jsonl(out)) == 4
    for flag in ("--resume", "--append", "--resume"):
        assert main(["run", str(spec), "--out", str(out), flag]) == 0
        keys = [record_key(r) for r in read_jsonl(out)]
        assert len(keys) == len(set(keys)) == 8


def test_a_measurement_refusing_its_parameters_names_the_spec(tmp_path, capsys):
    spec = _spec(
        tmp_path,
        'benchmark = "test-counter"\n[params.benchmark]\nrefuse = true\n',
        "refusing-quick.toml",
    )
    out = tmp_path / "r.jsonl"
    assert main(["run", str(spec), "--out", str(out)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("defense-suite: error: refusing-quick: [params.benchmark]")
    assert "refuse" in line
    assert not out.exists()
