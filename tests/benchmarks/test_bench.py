"""``defense-suite bench``: parallel workers, timing specs alone, failures per spec."""

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest

from defense_suite import workers
from defense_suite.bench import (
    TIMES_FILE,
    default_jobs,
    exclusive,
    longest_first,
    measures_time,
    read_times,
    run_bench,
    timed,
)
from defense_suite.cli import main
from defense_suite.spec import SpecError, load_spec, parse
from defense_suite.workers import ONE_THREAD, Jobs, Outcome, Pool, Worker
from tests.benchmarks.test_cli import SPEC

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "benchmarks" / "specs"
COMPARED = ("scenario", "attack", "defense", "seed", "params", "threat")
SECTIONS = ("utility", "success", "certificate")
WAIVED = {
    "crypto_sweep-quick",
    "composition_s3t_rps-quick",
    "crypto_attention-quick",
    "crypto_lora-quick",
}
"""Quick timing specs that run in a one-thread worker ([run] exclusive = false)."""


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        ("cost.step_s", True),
        ("cost.ms_per_sequence", True),
        ("cost.target_p50_ms", True),
        ("cost.seconds", True),
        ("cost.projected_step_cpu_s", True),
        ("utility.speedup_vs_softmax", True),
        ("cost.refresh_rounds", False),
        ("cost.mb_per_seq", False),
        ("utility.accuracy", False),
        ("success.acc@1", False),
        ("cost.sessions", False),  # "sessions" is not the unit s
    ],
)
def test_a_time_is_told_by_the_words_of_its_key(metric, expected):
    assert measures_time(metric) is expected


def test_shipped_timing_claims_run_alone_or_one_at_a_time_and_the_others_beside():
    quick = {p.stem: load_spec(p) for p in sorted(SHIPPED.glob("*-quick.toml"))}
    alone = {name for name, spec in quick.items() if exclusive(spec)}
    assert {
        "ssd_perf-quick",
        "rps_perf-quick",
        "crypto_finetune-quick",
        "serve-quick",
    } <= alone
    assert not alone & {"reference-quick", "ssd-quick", "crypto_byo-quick", "rps-quick"}
    # timing specs in a worker (beside untimed specs, one at a time): each one's
    # measurement was checked beside a one-thread neighbour (docs/suite.md)
    waived = {n for n, spec in quick.items() if timed(spec) and not exclusive(spec)}
    assert waived == WAIVED


def test_run_table_overrides_the_claim_and_is_validated():
    base = {"title": "t", "benchmark": "b"}
    timed = base | {
        "report": {"summary": {"threat": "x", "metric": "cost.s", "defense": "d"}}
    }
    assert exclusive(parse(timed, "a")) is True
    assert exclusive(parse(timed | {"run": {"exclusive": False}}, "a")) is False
    assert exclusive(parse(base | {"run": {"exclusive": True}}, "a")) is True
    assert exclusive(parse(base, "a")) is False
    with pytest.raises(SpecError, match=r"run.exclusive must be true or false, got 1"):
        parse(base | {"run": {"exclusive": 1}}, "a")
    with pytest.raises(SpecError, match=r"unknown run key\(s\) \['threads'\]"):
        parse(base | {"run": {"threads": 2}}, "a")


def test_order_is_longest_first_with_untimed_specs_first(tmp_path, capsys):
    paths = [Path(f"{n}-quick.toml") for n in ("a", "b", "c", "d")]
    times = {"a-quick": 1.0, "b-quick": 30.0, "d-quick": 5.0}
    assert [p.stem[0] for p in longest_first(paths, times)] == ["c", "b", "d", "a"]
    assert read_times(tmp_path) == {}
    (tmp_path / TIMES_FILE).write_text("not json")
    assert read_times(tmp_path) == {}
    assert 1 <= default_jobs() <= 2
    for bad in ("0", "x", "-1"):
        assert main(["bench", "--jobs", bad]) == 2
        assert (
            f"--jobs: must be an integer >= 1, got '{bad}'" in capsys.readouterr().err
        )


def _job(name):
    return Path(f"{name}-quick.toml"), Path(f"{name}.jsonl")


def test_jobs_keep_timing_specs_apart_and_take_the_first_spec_allowed():
    specs = [_job(n) for n in ("t1", "a", "t2", "b", "t3")]
    jobs = Jobs(specs, {specs[0][0], specs[2][0], specs[4][0]})
    assert jobs.take() == specs[0]  # t1 runs: t2 and t3 must wait
    assert jobs.take() == specs[1]
    assert jobs.take() == specs[3]
    got = []
    waiting = threading.Thread(target=lambda: got.append(jobs.take()))
    waiting.start()
    waiting.join(timeout=0.2)
    assert waiting.is_alive()  # only timing specs are left
    assert got == []
    jobs.finished(specs[1][0])  # an untimed spec ending frees nothing
    waiting.join(timeout=0.2)
    assert waiting.is_alive()
    assert got == []
    jobs.finished(specs[0][0])
    waiting.join(timeout=5)
    assert got == [specs[2]]
    jobs.finished(specs[2][0])
    assert jobs.take() == specs[4]
    jobs.finished(specs[4][0])
    assert jobs.take() is None


class _FakeProcess:
    def poll(self):
        return None


class _FakeWorker:
    """A worker without a process: each spec holds it for a few milliseconds."""

    spans: ClassVar[list[tuple[str, float, float]]] = []

    def __init__(self, log_dir, number):
        self.process = _FakeProcess()

    def run(self, spec, out, mode, log):
        start = time.perf_counter()
        time.sleep(0.002 * (1 + len(self.spans) % 3))
        self.spans.append((spec.stem, start, time.perf_counter()))
        return Outcome(spec.stem, True, 1, 0.0, False)

    def close(self, interrupt=False):
        pass


def test_pool_runs_timing_specs_beside_untimed_ones_never_two_at_once(monkeypatch):
    monkeypatch.setattr(workers, "Worker", _FakeWorker)
    monkeypatch.setattr(_FakeWorker, "spans", [])
    specs = [_job(f"{kind}{n}") for n in range(12) for kind in ("t", "u")]
    timing = {spec for spec, _ in specs if spec.stem.startswith("t")}
    with Pool(3) as pool:
        names = [o.name for o in pool.run(specs, "overwrite", timing)]
    assert sorted(names) == sorted(spec.stem for spec, _ in specs)
    spans = [(s, a, b) for s, a, b in _FakeWorker.spans if s.startswith("t")]
    assert len(spans) == 12
    for i, (_, start, end) in enumerate(spans):
        for _, other_start, other_end in spans[i + 1 :]:
            assert end <= other_start or other_end <= start


def test_a_timing_spec_that_waives_exclusive_runs_in_a_worker_one_at_a_time(
    tmp_path, monkeypatch
):
    seen = {}

    class Spy:
        def __init__(self, size):
            seen["size"] = size

        def __enter__(self):
            return self

        def __exit__(self, *args):
            pass

        def run(self, specs, mode, one_at_a_time=()):
            seen["shared"] = {spec.stem for spec, _ in specs}
            seen["one_at_a_time"] = {spec.stem for spec in one_at_a_time}
            return iter(())

    timing = SPEC.replace('"success.auc"\npaper', '"cost.fit_s"\npaper')
    paths = []
    for name, text in (
        ("game", SPEC),
        ("timed", timing),
        ("waived", timing + "\n[run]\nexclusive = false\n"),
        ("untimed_alone", SPEC + "\n[run]\nexclusive = true\n"),
    ):
        paths.append(tmp_path / f"{name}-quick.toml")
        paths[-1].write_text(text)
    assert [timed(load_spec(p)) for p in paths] == [False, True, True, False]
    monkeypatch.setattr("defense_suite.bench.Pool", Spy)
    monkeypatch.setattr(
        "defense_suite.bench._alone",
        lambda path, out, mode: Outcome(path.stem, True, 1, 0.0, True),
    )
    lines = []
    run_bench(paths, tmp_path, "overwrite", 2, lines.append)
    assert seen["shared"] == {"game-quick", "waived-quick"}
    assert seen["one_at_a_time"] == {"waived-quick"}
    assert len(lines) == 2  # timed and untimed_alone, alone


def test_a_dead_worker_fails_its_spec_only(tmp_path):
    worker = Worker(tmp_path, 1)
    try:
        worker.process.send_signal(signal.SIGKILL)
        worker.process.wait()
        spec = tmp_path / "x-quick.toml"
        outcome = worker.run(spec, tmp_path / "x.jsonl", "overwrite", tmp_path / "l")
    finally:
        worker.close()
    assert not outcome.ok
    assert outcome.name == "x-quick"
    assert "worker died (killed by signal 9)" in outcome.error


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_parallel_bench_equals_a_serial_run_and_reports_each_spec(
    tmp_path, capsys, monkeypatch
):
    """Two game specs in two one-thread workers (the environment of each worker
    process read back from /proc) give the records a serial in-process ``run`` gives
    (every section but cost and meta, bit for bit); a timing spec runs alone, after
    them, and one that waives it runs in a worker; a spec that fails at run time is
    named on its own line, the others are written, the report is not, and the exit
    code is 1."""
    environments = []
    run = Worker.run

    def spying(self, *args):
        environments.append(Path(f"/proc/{self.process.pid}/environ").read_bytes())
        return run(self, *args)

    monkeypatch.setattr(Worker, "run", spying)
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "mini-quick.toml").write_text(SPEC.replace("[0, 1]", "[1]"))
    (specs / "other-quick.toml").write_text(
        SPEC.replace("[0, 1]", "[2]").replace('"none", "label-only"', '"none"')
    )
    timed = SPEC.replace("[0, 1]", "[3]").replace('"none", "label-only"', '"none"')
    timed = timed.replace('"success.auc"\npaper', '"cost.fit_s"\npaper')
    (specs / "timed-quick.toml").write_text(timed)
    waived = timed.replace("[3]", "[4]") + "\n[run]\nexclusive = false\n"
    (specs / "waived-quick.toml").write_text(waived)
    (specs / "broken-quick.toml").write_text(
        'benchmark = "rps-coverage"\n[params.benchmark]\nn_train_parts = "many"\n'
    )
    results = tmp_path / "results"
    args = ["bench", "--specs", str(specs), "--results", str(results), "--jobs", "2"]
    assert main(args) == 1
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 5, captured.out
    by_name = {line.split("] ")[1].split(":")[0]: line for line in lines}
    names = {"mini-quick", "other-quick", "timed-quick", "waived-quick", "broken-quick"}
    assert set(by_name) == names
    assert "2 records in" in by_name["mini-quick"]
    assert "(beside others)" in by_name["mini-quick"]
    assert "(beside others)" in by_name["waived-quick"]  # in a worker
    assert lines[-1] == by_name["timed-quick"]  # alone, after the workers
    assert "1 record in" in by_name["timed-quick"]
    assert "(alone)" in by_name["timed-quick"]
    assert "FAILED" in by_name["broken-quick"]
    assert "n_train_parts" in by_name["broken-quick"]
    assert "1 of 5 specs failed (broken-quick); no report" in captured.err
    assert not (results / "REPORT.md").exists()
    assert not (results / "broken-quick.jsonl").exists()
    times = json.loads((results / TIMES_FILE).read_text())
    assert set(times) == names - {"broken-quick"}
    assert times["timed-quick"]["alone"] is True
    assert times["waived-quick"]["alone"] is False
    assert len(environments) == 4  # the four shared specs, each in a worker
    for environment in environments:
        variables = set(environment.split(b"\0"))
        assert {f"{k}={v}".encode() for k, v in ONE_THREAD.items()} <= variables

    serial = tmp_path / "serial.jsonl"
    assert main(["run", str(specs / "mini-quick.toml"), "--out", str(serial)]) == 0
    parallel = _records(results / "mini-quick.jsonl")
    alone = _records(serial)
    assert len(parallel) == len(alone) == 2
    for mine, theirs in zip(parallel, alone, strict=True):
        for key in (*COMPARED, *SECTIONS):
            assert mine[key] == theirs[key], key


@pytest.mark.slow
def test_the_one_thread_environment_reaches_torch_and_numba():
    """torch and numba read it at import (a property of the libraries, checked once
    in the slow tier; the fast tier checks that every worker has it)."""
    import subprocess
    import sys

    probe = (
        "import torch, numba; print(torch.get_num_threads(), numba.get_num_threads())"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, **ONE_THREAD},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["1", "1"]


def _processes_with(tag):
    """Pids of the processes whose environment holds ``tag`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and tag in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_ctrl_c_stops_the_workers_and_keeps_no_part_of_a_running_spec(tmp_path):
    """SIGINT to the bench alone (as ``kill -INT``): exit 130 at once, the specs
    that finished keep their files, the running one leaves none, no worker lives on."""
    import subprocess
    import sys
    import time

    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "a-quick.toml").write_text(SPEC.replace("[0, 1]", "[0]"))
    many = ", ".join(str(s) for s in range(60))
    (specs / "b-quick.toml").write_text(SPEC.replace("[0, 1]", f"[{many}]"))
    results = tmp_path / "results"
    tag = f"DEFENSE_SUITE_TEST_TAG={os.getpid()}-{time.time_ns()}"
    key, value = tag.split("=")
    argv = ["bench", "--specs", str(specs), "--results", str(results), "--jobs", "2"]
    bench = subprocess.Popen(
        [sys.executable, "-m", "defense_suite", *argv],
        cwd=REPO,
        env={**os.environ, key: value},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = bench.stdout.readline()  # a-quick's line: b-quick is still running
    assert "a-quick: 2 records" in first, first + bench.stderr.read()
    assert len(_processes_with(tag.encode())) == 3  # the bench and two workers
    bench.send_signal(signal.SIGINT)
    assert bench.wait(timeout=60) == 130
    assert "interrupted" in bench.stderr.read()
    assert (results / "a-quick.jsonl").exists()
    assert sorted(p.name for p in results.iterdir()) == ["a-quick.jsonl"]
    deadline = time.monotonic() + 30
    while _processes_with(tag.encode()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_with(tag.encode()) == []


def _two_specs_and_results(tmp_path):
    """A spec with plots, one without, and two seeds of two arms of each."""
    from tests.benchmarks.records import auc_record

    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "mini-quick.toml").write_text(SPEC)  # plots accuracy against AUC
    axes = 'x = "utility.accuracy"\ny = "success.auc"\n'
    assert axes in SPEC
    (specs / "plain-quick.toml").write_text(SPEC.replace(axes, ""))
    records = [
        auc_record(defense, auc, seed, accuracy, spec=spec)
        for spec in ("mini-quick", "plain-quick")
        for seed in (0, 1)
        for defense, auc, accuracy in (("none", 0.7, 0.9), ("rounding", 0.55, 0.85))
    ]
    results = tmp_path / "all.jsonl"
    results.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    return specs, results


def _report_lines(path):
    return [x for x in path.read_text().splitlines() if not x.startswith("Generated")]


class _DrawingWorker:
    """A worker without a process: it answers a draw job as a worker does (the job
    and the answer through JSON), or, once dead, with nothing."""

    def __init__(self, log_dir, number):
        self.process = _FakeProcess()
        self.dead = number == 2
        self.parts = []

    def call(self, job):
        if self.dead:
            return ""
        self.parts.append(job["draw"]["name"])
        return json.dumps(workers._draw(json.loads(json.dumps(job))["draw"]))

    def close(self, interrupt=False):
        pass


def test_pool_draw_gives_the_parts_in_order_and_draws_a_dead_workers_here(
    tmp_path, monkeypatch
):
    from defense_suite.report import write_report

    monkeypatch.setattr(workers, "Worker", _DrawingWorker)
    specs, results = _two_specs_and_results(tmp_path)
    serial = write_report([results], specs, tmp_path / "serial" / "REPORT.md")
    with Pool(2) as pool:
        drawn = write_report(
            [results], specs, tmp_path / "pool" / "REPORT.md", draw=pool.draw
        )
    assert _report_lines(drawn) == _report_lines(serial)
    alive = pool.workers[0].parts
    assert alive  # the live worker drew parts; the dead one's were drawn here
    assert set(alive) <= {"mini-quick", "plain-quick", "digits"}
    for name in ("mini-quick.png", "mini-quick-delta.png"):
        assert (drawn.parent / "plots" / name).read_bytes() == (
            serial.parent / "plots" / name
        ).read_bytes()


@pytest.mark.slow
def test_the_idle_workers_draw_the_report_a_serial_draw_gives(tmp_path):
    """The report's parts (a section with its tradeoff and delta plots, and one
    without plots) drawn by two worker processes give the same Markdown and the
    same PNG bytes as drawn here, in order; after one is killed, the other and
    this process draw them."""
    from defense_suite.report import write_report

    specs, results = _two_specs_and_results(tmp_path)
    serial = write_report([results], specs, tmp_path / "serial" / "REPORT.md")
    with Pool(2) as pool:
        parallel = write_report(
            [results], specs, tmp_path / "parallel" / "REPORT.md", draw=pool.draw
        )
        pool.workers[0].process.send_signal(signal.SIGKILL)
        pool.workers[0].process.wait()
        survivor = write_report(
            [results], specs, tmp_path / "survivor" / "REPORT.md", draw=pool.draw
        )

    assert _report_lines(parallel) == _report_lines(serial)
    assert _report_lines(survivor) == _report_lines(serial)
    pngs = sorted(p.name for p in (serial.parent / "plots").glob("*.png"))
    assert pngs == ["mini-quick-delta.png", "mini-quick.png"]
    for folder in (parallel.parent, survivor.parent):
        for name in pngs:
            drawn = (folder / "plots" / name).read_bytes()
            assert drawn == (serial.parent / "plots" / name).read_bytes(), name
