r"""``defense-suite bench``: every spec of a profile, in parallel where that is safe.

A profile's specs are independent, so ``bench --jobs N`` (default: two, or one on a
one-core machine) runs them in ``N`` worker processes (:mod:`defense_suite.workers`),
each on **one thread** (torch, OpenMP, BLAS, numba), so that ``N`` workers use ``N``
cores and never oversubscribe them. A spec whose claim is a time (a speed-up, a cost
budget, a latency) would read another spec's load as its own, so by default it runs
**alone**: in this process, with its usual threads, while no worker runs
(:func:`exclusive`). A timing spec that sets ``[run] exclusive = false`` states that
its measurement holds on one thread beside one-thread work on the other cores (CPU
seconds of its own process, or a one-thread computation that keeps its core to
itself): it runs in a worker, **beside untimed specs only**, never two timing specs
at once (:class:`~defense_suite.workers.Jobs`).

Schedule: the workers start first (their imports overlap this process's check of
every spec) and take the shared specs longest first (greedy list scheduling: each
free worker takes the longest spec left that it may run), by the seconds each took
in the last bench of that results folder (``bench-times.json``; a spec never timed
counts as longest); when they are done and closed, the specs that run alone run
here, one after another. With ``N`` workers and a longest spec :math:`t_{max}` the
parallel part ends within :math:`\sum t / N + t_{max}` (Graham's bound for list
scheduling) when no spec waits; the one-at-a-time specs run one after another, so
it lasts at least the sum of their seconds (well below :math:`\sum t / N` in the
quick profile, where ``crypto_sweep`` is the one).

Each finished spec prints one line with its time; a failed spec is reported with its
error and log and the others run on; the report is written only when every spec
succeeded (a stale results file is never reported as this run's), its plots drawn
by the workers, idle by then, in parallel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from defense_suite.spec import Spec, load_spec
from defense_suite.workers import Outcome, Pool, run_spec

if TYPE_CHECKING:
    from defense_suite.report import Draw

logger = logging.getLogger(__name__)

TIMES_FILE = "bench-times.json"
"""Seconds per spec of the last bench, in its results folder (orders the next)."""

TIME_WORDS = frozenset({"s", "ms", "us", "ns", "seconds", "time", "latency", "speedup"})
"""Words of a metric's key (split at '_') that make it a time or a time ratio."""


def measures_time(metric: str) -> bool:
    """Whether ``metric`` (``section.key``) is a time, a latency or a speed-up.

    ``cost.step_s``, ``cost.ms_per_sequence``, ``cost.target_p50_ms``,
    ``cost.seconds`` and ``utility.speedup_vs_softmax`` are; ``cost.refresh_rounds``
    and ``utility.accuracy`` are not.
    """
    _, _, key = metric.partition(".")
    return bool(TIME_WORDS.intersection(key.lower().split("_")))


def timed(spec: Spec) -> bool:
    """Whether ``spec``'s claim (``[report.summary] metric``) is a time."""
    summary = spec.report.summary
    return summary is not None and measures_time(summary.metric)


def exclusive(spec: Spec) -> bool:
    """Whether ``spec`` must run alone.

    ``[run] exclusive`` when the spec sets it, else whether its claim is a time
    (:func:`timed`).
    """
    return timed(spec) if spec.exclusive is None else spec.exclusive


def default_jobs() -> int:
    """Two workers, or one on a machine with one core for this process."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def read_times(results_dir: Path) -> dict[str, float]:
    """Seconds per spec from the last bench into ``results_dir`` (empty if none)."""
    try:
        data = json.loads((results_dir / TIMES_FILE).read_text(encoding="utf-8"))
        return {
            str(k): float(v["seconds"])
            for k, v in data.items()
            if isinstance(v, dict) and isinstance(v.get("seconds"), int | float)
        }
    except (OSError, ValueError, AttributeError):
        return {}


def write_times(results_dir: Path, outcomes: Sequence[Outcome], jobs: int) -> None:
    """Record each successful spec's seconds (keeping other specs' older entries)."""
    path = results_dir / TIMES_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    for o in outcomes:
        if o.ok:
            data[o.name] = {"seconds": round(o.seconds, 1), "alone": o.alone}
    data = dict(sorted(data.items()))
    try:
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    except OSError as error:
        logger.warning("could not record the specs' times in %s: %s", path, error)


def longest_first(paths: Sequence[Path], times: dict[str, float]) -> list[Path]:
    """``paths`` by their last time, longest first; never-timed specs before all."""
    return sorted(paths, key=lambda p: (-times.get(p.stem, float("inf")), p.stem))


def _alone(path: Path, out: Path, mode: str) -> Outcome:
    start = time.perf_counter()
    try:
        n = run_spec(path, out, mode)
    except Exception as error:  # reported per spec; the rest run on
        logger.error("%s failed", path.name, exc_info=True)
        message = " ".join(str(error).split()) or type(error).__name__
        return Outcome(path.stem, False, 0, time.perf_counter() - start, True, message)
    return Outcome(path.stem, True, n, time.perf_counter() - start, True)


def run_bench(
    paths: Sequence[Path],
    results_dir: Path,
    mode: str,
    jobs: int | None,
    say: Callable[[str], None],
    check: Callable[[], None] = lambda: None,
    report: Callable[[Draw], object] | None = None,
) -> list[Outcome]:
    """Run every spec in ``paths`` into ``results_dir/<name>.jsonl``.

    With ``jobs == 1`` every spec runs in this process, one after another, as before
    parallel runs existed. Otherwise ``jobs`` one-thread workers start at once (their
    imports overlap ``check``, which checks every spec before any runs), run the
    specs :func:`exclusive` does not name, longest first, the :func:`timed` ones
    among them one at a time, and are closed; then the exclusive specs run here,
    alone. ``say`` gets one line per finished spec. When every spec succeeded,
    ``report`` is called with a :data:`~defense_suite.report.Draw` that hands the
    report's parts to the workers, idle since their last spec (they stay open,
    blocked on their input, while the exclusive specs run), or draws them here
    when there were none. Returns the outcomes in the order the specs finished.
    """
    jobs = default_jobs() if jobs is None else jobs
    specs = {p: load_spec(p) for p in paths}
    alone = [p for p in paths if jobs == 1 or exclusive(specs[p])]
    shared = longest_first(
        [p for p in paths if p not in alone], read_times(results_dir)
    )
    one_at_a_time = {p for p in shared if timed(specs[p])}
    total = len(paths)
    outcomes: list[Outcome] = []
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(Pool(min(jobs, len(shared)))) if shared else None
        check()
        if pool is not None:
            for outcome in pool.run(
                [(p, results_dir / f"{p.stem}.jsonl") for p in shared],
                mode,
                one_at_a_time,
            ):
                outcomes.append(outcome)
                say(outcome.line(len(outcomes), total))
        for path in alone:
            logger.info("running %s alone", path.name)
            outcomes.append(_alone(path, results_dir / f"{path.stem}.jsonl", mode))
            say(outcomes[-1].line(len(outcomes), total))
        write_times(results_dir, outcomes, jobs)
        if report is not None and all(o.ok for o in outcomes):
            from defense_suite.report import draw_parts

            report(draw_parts if pool is None else pool.draw)
    return outcomes


def _jobs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` sub-command's own arguments."""
    parser.add_argument("--profile", choices=("quick", "full"), default="quick")
    parser.add_argument("--only", nargs="+", help="packages to run (e.g. ssd rps)")
    parser.add_argument(
        "--resume", action="store_true", help="skip records already in results/"
    )
    parser.add_argument(
        "--jobs",
        type=_jobs,
        default=None,
        help="specs run at once, one thread each (default: 2, or 1 on one core); "
        "a spec whose claim is a time runs alone; 1: all in this process",
    )
