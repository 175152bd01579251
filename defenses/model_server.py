"""A served model under load: MLflow's model server and a bounded load loop.

:class:`ModelServer` runs ``mlflow models serve -m PATH --env-manager local`` on
127.0.0.1 (``--env-manager local``: MLflow builds no environment and needs no
network; it execs ``uvicorn`` by name, so the interpreter's ``bin`` folder is put
first on ``PATH``) and stops it, its workers included, on exit.

:func:`load` is the load generator: an asyncio loop over the loopback interface
with a fixed number of requests, ``concurrency`` keep-alive connections and a time
cap; a request still unanswered at the cap counts as an error, so the loop always
ends. It records each request's latency (from writing the request to reading the
whole answer) and status.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from defenses.checks import check_int, check_real


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class ModelServer:
    """``mlflow models serve`` of one saved model, as a context manager.

    Parameters
    ----------
    model_uri : str
        A model folder or any MLflow model URI.
    workers : int
        Uvicorn worker processes (``--workers``).
    start_timeout_s : float
        How long to wait for ``GET /ping`` to answer 200.
    """

    model_uri: str
    workers: int = 2
    start_timeout_s: float = 180.0
    port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_int("workers", self.workers, 1, 64)
        check_real("start_timeout_s", self.start_timeout_s, 0.0, open_low=True)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts the server."""
        return [
            sys.executable, "-m", "mlflow", "models", "serve",
            "-m", str(self.model_uri), "--env-manager", "local",
            "-h", "127.0.0.1", "-p", str(self.port), "--workers", str(self.workers),
        ]  # fmt: skip

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's output."""
        if self._log is None:
            return ""
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def cause(self) -> str:
        """The error line that stopped the server (a worker's exception), or ''.

        MLflow reports a worker that failed to load the model as its own generic
        ``Exception: Command ... returned non zero return code``; the worker's
        exception line above it (``...StateError: data/shield/state.npz: ...``)
        says why.
        """
        if self._log is None:
            return ""
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace")
        found = [
            line
            for line in text.splitlines()
            if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b[^:]*: ", line)
            and not line.startswith("Exception: Command")
        ]
        return found[-1] if found else ""

    def launch(self) -> ModelServer:
        """Start the server process (see :meth:`wait` and :meth:`start`)."""
        self.port = free_port()
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed by stop)
            prefix="mlflow-serve-", suffix=".log"
        )
        self.process = subprocess.Popen(
            self.command(),
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    def wait(self) -> ModelServer:
        """Wait until the launched server answers ``/ping`` (stop it on failure)."""
        if self.process is None:
            raise RuntimeError("the server was not launched")
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                cause, tail = self.cause(), self.log_tail()
                self.stop()
                raise RuntimeError(
                    f"mlflow models serve exited early: {cause or 'see below'}\n{tail}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/ping", timeout=2) as answer,
            ):
                if answer.status == 200:
                    return self
            time.sleep(0.25)
        tail = self.log_tail()
        self.stop()
        raise TimeoutError(f"the server did not answer /ping in time:\n{tail}")

    def start(self) -> ModelServer:
        """Start the server and wait until it answers ``/ping``."""
        return self.launch().wait()

    def stop(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after 15 s)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=15)
        if self._log is not None:
            self._log.close()
            self._log = None

    def post(
        self, body: str | bytes, content_type: str = "application/json"
    ) -> tuple[int, str]:
        """``POST /invocations``; returns the status and the body text."""
        data = body.encode() if isinstance(body, str) else body
        request = urllib.request.Request(
            f"{self.url}/invocations",
            data=data,
            headers={"Content-Type": content_type},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return int(answer.status), answer.read().decode()
        except urllib.error.HTTPError as error:
            return int(error.code), error.read().decode()

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@dataclass(frozen=True)
class LoadResult:
    """What one load run measured."""

    latencies_s: npt.NDArray[np.float64]
    errors: int
    wall_s: float

    @property
    def ok(self) -> int:
        """Requests answered 200."""
        return int(self.latencies_s.size)

    def percentile_ms(self, q: float) -> float:
        """The ``q``-th percentile of the answered requests' latency, in ms."""
        if not self.latencies_s.size:
            return float("nan")
        return float(np.percentile(self.latencies_s, q) * 1e3)

    @property
    def rps(self) -> float:
        """Answered requests per second of wall time."""
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> int:
    """Send one request on a keep-alive connection; return the status."""
    writer.write(request)
    await writer.drain()
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    await reader.readexactly(length)
    return status


async def _load(
    port: int, body: bytes, requests: int, concurrency: int, time_cap_s: float
) -> LoadResult:
    head = (
        f"POST /invocations HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    request = head + body
    latencies: list[float] = []
    errors = 0
    remaining = requests
    in_flight = 0
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal remaining, errors, in_flight
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while remaining > 0:
                remaining -= 1
                in_flight += 1
                sent = time.perf_counter()
                try:
                    status = await _exchange(reader, writer, request)
                except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
                    errors += 1
                    in_flight -= 1
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    continue
                in_flight -= 1
                if status == 200:
                    latencies.append(time.perf_counter() - sent)
                else:
                    errors += 1
        finally:
            writer.close()

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, requests))]
    done, pending = await asyncio.wait(tasks, timeout=time_cap_s)
    for task in pending:
        task.cancel()
    for task in done:
        if task.exception() is not None:
            errors += 1
    errors += max(remaining, 0) + in_flight
    wall = time.perf_counter() - start
    return LoadResult(np.array(latencies, dtype=np.float64), errors, wall)


def load(
    port: int,
    body: bytes,
    requests: int,
    concurrency: int = 1,
    time_cap_s: float = 60.0,
) -> LoadResult:
    """Send ``requests`` copies of ``body`` with ``concurrency`` connections.

    The loop stops at ``time_cap_s``; requests not sent or not answered by then
    count as errors (as does any answer other than 200).
    """
    check_int("requests", requests, 1)
    check_int("concurrency", concurrency, 1, 1024)
    check_real("time_cap_s", time_cap_s, 0.0, open_low=True)
    return asyncio.run(_load(port, body, requests, concurrency, time_cap_s))


def batch_body(rows: npt.NDArray[Any]) -> bytes:
    """An ``{"inputs": [[...], ...]}`` body (floats written exactly, as repr)."""
    inner = ",".join("[" + ",".join(repr(float(v)) for v in row) + "]" for row in rows)
    return ('{"inputs":[' + inner + "]}").encode()
