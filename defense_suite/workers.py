"""Workers of ``defense-suite bench --jobs N``: one spec at a time, on one thread.

A worker is ``python -m defense_suite.workers``, started with the thread counts of
torch, OpenMP, the BLAS libraries and numba set to one (:data:`ONE_THREAD`, read by
those libraries when they load, so before anything is imported). It reads one job a
line on stdin (``{"spec", "out", "mode", "log"}``, JSON) and answers one line
(``{"ok", "records", "seconds", "error"}``) on the stdout it was started with; while
a spec runs, the worker's file descriptors 1 and 2 point at that spec's log, so
everything the spec prints (its progress lines, warnings, a C library's output, the
processes it starts) lands there and the bench's own output stays one line a spec.

A worker lives for many specs, so the imports and the registry's discovery are paid
once per worker, not per spec. After the last spec, the same idle workers draw the
report's plots (a job ``{"draw": part}`` answered ``{"ok", "lines", "error"}``:
:meth:`Pool.draw`). A worker that dies (a crash in a C extension, out of
memory) fails only the spec it was running; the next spec gets a fresh worker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from defense_suite.spec import load_spec

if TYPE_CHECKING:
    from defense_suite.report import Part

logger = logging.getLogger(__name__)

ONE_THREAD = {
    name: "1"
    for name in (
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "BLIS_NUM_THREADS",
        "VECLIB_MAXIMUM_THREADS",
        "NUMEXPR_NUM_THREADS",
        "NUMBA_NUM_THREADS",
    )
}
"""Environment of a worker: every math library on one thread."""


@dataclass(frozen=True)
class Outcome:
    """How one spec's run ended."""

    name: str
    ok: bool
    records: int
    seconds: float
    alone: bool
    error: str = ""
    log: str = ""

    def line(self, number: int, total: int) -> str:
        """``[ 3/29] crypto-quick: 12 records in 57.1 s (beside others)``."""
        where = "alone" if self.alone else "beside others"
        head = f"[{number:>{len(str(total))}}/{total}] {self.name}"
        if self.ok:
            plural = "" if self.records == 1 else "s"
            took = f"{self.records} record{plural} in {self.seconds:.1f} s"
            return f"{head}: {took} ({where})"
        log = f"; log: {self.log}" if self.log else ""
        return f"{head}: FAILED after {self.seconds:.1f} s ({where}): {self.error}{log}"


def run_spec(path: Path, out: Path, mode: str) -> int:
    """Run the spec at ``path`` into ``out`` as ``defense-suite run`` does.

    ``mode`` is ``"overwrite"`` or ``"resume"`` (skip the records ``out`` holds).
    Returns the number of records written.
    """
    from defense_suite.output import (
        check_output,
        interrupt_watch,
        read_results,
        write_results,
    )
    from defense_suite.runner import plan, record_key, run_plan

    check_output(out)
    chosen = plan(load_spec(path), None, str(path))
    existing = read_results(out) if mode == "resume" and out.exists() else []
    skip = {record_key(r) for r in existing}
    with interrupt_watch() as check:
        return write_results(
            out, run_plan(chosen, skip, check), keep_existing=mode != "overwrite"
        )


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


class Worker:
    """One worker process and the pipe to it."""

    def __init__(self, log_dir: Path, number: int) -> None:
        self.log = log_dir / f"worker-{number}.log"
        with self.log.open("w", encoding="utf-8") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "defense_suite.workers"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={**os.environ, **ONE_THREAD},
            )

    def call(self, job: dict[str, Any]) -> str:
        """Send one job line; its answer line, or "" if the worker is dead."""
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        try:
            self.process.stdin.write(json.dumps(job) + "\n")
            self.process.stdin.flush()
            return self.process.stdout.readline()
        except OSError:
            return ""

    def run(self, spec: Path, out: Path, mode: str, log: Path) -> Outcome:
        """Run one spec in the worker; a dead worker gives a failed outcome."""
        start = time.perf_counter()
        job = {"spec": str(spec), "out": str(out), "mode": mode, "log": str(log)}
        answer = self.call(job)
        seconds = time.perf_counter() - start
        if not answer:
            code = self.process.wait()
            why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            return Outcome(
                spec.stem, False, 0, seconds, False, f"worker died ({why})", str(log)
            )
        reply = json.loads(answer)
        return Outcome(
            spec.stem,
            bool(reply["ok"]),
            int(reply["records"]),
            float(reply["seconds"]),
            False,
            str(reply.get("error", "")),
            "" if reply["ok"] else str(log),
        )

    def close(self, interrupt: bool = False) -> None:
        """End the worker: end of input, then SIGINT, then kill (10 s apart).

        With ``interrupt`` (the bench was interrupted or failed) SIGINT comes at
        once: the spec running is abandoned and its results file left as it was.
        """
        if self.process.poll() is None and self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        stops = (signal.SIGINT, signal.SIGKILL)
        for stop in stops if interrupt else (None, *stops):
            if stop is not None and self.process.poll() is None:
                self.process.send_signal(stop)
            try:
                self.process.wait(timeout=10)
                return
            except subprocess.TimeoutExpired:
                continue


class Pool:
    """``size`` workers fed from one list of specs, longest first (as given)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.log_dir = Path(tempfile.mkdtemp(prefix="defense-suite-bench-"))
        self.failed = False
        # started now, so that their imports overlap whatever the caller does next
        self.workers = [Worker(self.log_dir, n) for n in range(1, size + 1)]

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        interrupted = exc_info[0] is not None
        if interrupted:  # every worker stops its spec at once
            for worker in self.workers:
                if worker.process.poll() is None:
                    worker.process.send_signal(signal.SIGINT)
        for worker in self.workers:
            worker.close(interrupt=interrupted)
        if not self.failed:
            for path in self.log_dir.iterdir():
                path.unlink()
            self.log_dir.rmdir()
        else:
            logger.warning("the workers' logs are kept in %s", self.log_dir)

    def _drive(self, number: int, jobs: Jobs, mode: str, done: Any) -> None:
        worker: Worker | None = self.workers[number - 1]
        while True:
            job = jobs.take()
            if job is None:
                return
            spec, out = job
            if worker is None:
                worker = Worker(self.log_dir, number)
                self.workers.append(worker)
            try:
                outcome = worker.run(spec, out, mode, self.log_dir / f"{spec.stem}.log")
            finally:
                jobs.finished(spec)
            if worker.process.poll() is not None:
                worker = None  # died: the next spec gets a fresh one
            done.put(outcome)

    def run(
        self,
        specs: Sequence[tuple[Path, Path]],
        mode: str,
        one_at_a_time: Collection[Path] = (),
    ) -> Iterator[Outcome]:
        """Run every ``(spec, out)``; yield each outcome as its spec finishes.

        The specs in ``one_at_a_time`` never run two at once (:class:`Jobs`).
        """
        jobs = Jobs(specs, one_at_a_time)
        done: queue.Queue[Outcome] = queue.Queue()
        for number in range(1, self.size + 1):
            threading.Thread(
                target=self._drive, args=(number, jobs, mode, done), daemon=True
            ).start()
        for _ in specs:
            while True:
                try:
                    outcome = done.get(timeout=0.5)
                    break
                except queue.Empty:
                    continue
            self.failed = self.failed or not outcome.ok
            yield outcome

    def draw(self, parts: Sequence[Part]) -> list[list[str]]:
        """Each report part's lines (:func:`~defense_suite.report.draw_part`), in order.

        The live workers take the parts from one queue; a part whose worker failed
        or died is drawn here afterwards, so the report is the one
        :func:`~defense_suite.report.draw_parts` gives.
        """
        from defense_suite.report import draw_part

        lines: list[list[str] | None] = [None] * len(parts)
        left: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(len(parts)):
            left.put(index)

        def drive(worker: Worker) -> None:
            while worker.process.poll() is None:
                try:
                    index = left.get_nowait()
                except queue.Empty:
                    return
                answer = worker.call({"draw": asdict(parts[index])})
                reply: dict[str, Any] = json.loads(answer) if answer else {"ok": False}
                if reply["ok"]:
                    lines[index] = [str(line) for line in reply["lines"]]
                else:
                    logger.warning(
                        "report part %s: the worker failed (%s); drawn here",
                        parts[index].name,
                        reply.get("error", "worker died"),
                    )

        threads = [
            threading.Thread(target=drive, args=(worker,), daemon=True)
            for worker in self.workers
            if worker.process.poll() is None
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [
            drawn if drawn is not None else draw_part(part)
            for drawn, part in zip(lines, parts, strict=True)
        ]


class Jobs:
    """The specs left to run, in the order given, shared by the pool's workers.

    A free worker takes the first spec it may run: any spec, except one of
    ``one_at_a_time`` (timing specs run beside untimed ones only) while another of
    them runs; it waits when every spec left is of those and one runs.
    """

    def __init__(
        self, specs: Sequence[tuple[Path, Path]], one_at_a_time: Collection[Path] = ()
    ) -> None:
        self.left = list(specs)
        self.one_at_a_time = frozenset(one_at_a_time)
        self.running: set[Path] = set()
        self.changed = threading.Condition()

    def take(self) -> tuple[Path, Path] | None:
        """The next spec for a free worker (waiting if need be); None when none left."""
        with self.changed:
            while self.left:
                busy = bool(self.running & self.one_at_a_time)
                for index, (spec, out) in enumerate(self.left):
                    if not (busy and spec in self.one_at_a_time):
                        del self.left[index]
                        self.running.add(spec)
                        return spec, out
                self.changed.wait()
            return None

    def finished(self, spec: Path) -> None:
        """``spec`` is done (or failed): a waiting worker may take the next."""
        with self.changed:
            self.running.discard(spec)
            self.changed.notify_all()


def _serve(reply: IO[str]) -> None:
    """The worker's loop: one job a line on stdin, one answer a line on ``reply``."""
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    for line in sys.stdin:
        job = json.loads(line)
        if "draw" in job:
            reply.write(json.dumps(_draw(job["draw"])) + "\n")
            reply.flush()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        start = time.perf_counter()
        answer: dict[str, Any] = {"ok": True, "records": 0, "error": ""}
        try:
            answer["records"] = run_spec(
                Path(job["spec"]), Path(job["out"]), job["mode"]
            )
        except Exception as error:  # reported per spec, not raised
            logger.exception("%s failed", job["spec"])
            answer.update(ok=False, error=_one_line(error))
        answer["seconds"] = time.perf_counter() - start
        sys.stdout.flush()
        sys.stderr.flush()
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


def _draw(part: dict[str, Any]) -> dict[str, Any]:
    """The answer to a ``draw`` job: the part's lines, or the error in one line."""
    from defense_suite.report import Part, draw_part

    try:
        return {"ok": True, "lines": draw_part(Part(**part)), "error": ""}
    except Exception as error:  # the lead process draws it again and says why
        logger.exception("report part %s failed", part.get("name"))
        return {"ok": False, "lines": [], "error": _one_line(error)}


def _warm_up() -> None:
    """Import every package and register its components before the first job."""
    from defenses.registry import discover

    try:
        discover()
    except Exception:  # the first spec's plan names what is wrong
        logger.warning("discovery failed; each spec will say why", exc_info=True)


def main() -> int:
    """Entry point of ``python -m defense_suite.workers``."""
    reply = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # nothing but answers on the reply pipe
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        _warm_up()
        _serve(reply)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
