"""Real Flower processes on loopback for the deployment tests (``--runslow``).

A SuperLink and SuperNodes run as separate processes with their logs in files; every
process is stopped when the test leaves the block, whatever happened. Each SuperNode
has its own node config: partition, budget (:data:`BUDGETS`), the full agreement
(:data:`AGREEMENT`) and a ledger file of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flower-own-model"
BIN = Path(sys.executable).parent
BUDGETS = (1.0, 3.0, 8.0)
AGREEMENT = (
    'delta=1e-5 rounds=3 local-steps=4 sigma=1.0 spending="time-adaptive" '
    'save-fraction=0.5 save-ratio=0.7 accountant="rdp" '
    "data-seed=0 public-num-examples=400"
)
"""Each SuperNode's own privacy agreement and data (a deployment reads no run
config): its public record count and the seed of its partition and public split."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def flower_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of every process: Flower's home, no telemetry, no installs."""
    return {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        **extra,
    }


def superlink_home(folder: Path, port: int, ca: Path | None = None) -> Path:
    """A Flower home whose default SuperLink ``test`` is 127.0.0.1:``port``
    (insecure, or over TLS with the CA certificate ``ca``)."""
    home = folder / "home"
    home.mkdir()
    security = "insecure = true" if ca is None else f'root-certificates = "{ca}"'
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
        f'address = "127.0.0.1:{port}"\n{security}\n'
    )
    return home


def simulation_home(folder: Path, supernodes: int) -> Path:
    """A Flower home whose default SuperLink is the local simulation of
    ``supernodes`` SuperNodes."""
    home = folder / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
        f"options.num-supernodes = {supernodes}\n"
    )
    return home


def simulation_env(
    folder: Path, supernodes: int, port: int, **extra: str
) -> dict[str, str]:
    """The environment of a ``flwr run`` in local simulation (:func:`simulation_home`
    under ``folder``): this interpreter's scripts first on ``PATH``, the local
    SuperLink's HTTP API on ``port``, its control API on ``port + 2``, and ``extra``."""
    return {
        **os.environ,
        "FLWR_HOME": str(simulation_home(folder, supernodes)),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(port + 2),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        **extra,
    }


def left_running(env: dict[str, str]) -> list[int]:
    """Local SuperLinks still running on ``env``'s port (stopped, then listed)."""
    from defense_suite.federated.__main__ import local_superlink_pids, stop_process

    pids = local_superlink_pids(env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"])
    for pid in pids:
        stop_process(pid)
    return pids


def trusted_entities(folder: Path) -> Path:
    """A ``--trusted-entities`` file listing one fresh Ed25519 publisher key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate().public_key()
    openssh = key.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()
    trusted = folder / "trusted.yaml"
    trusted.write_text(f'publisher-key: "{openssh}"\n')
    return trusted


def node_config(i: int, ledger: Path) -> str:
    """SuperNode ``i``'s node config (partition ``min(i, 2)`` of three)."""
    part = min(i, 2)
    return (
        f"partition-id={part} num-partitions=3 epsilon={BUDGETS[part]} "
        f'{AGREEMENT} ledger-init=true ledger-path="{ledger}"'
    )


def supernode_args(i: int, port: int, folder: Path) -> list[str]:
    """Arguments of insecure SuperNode ``i`` (its ledger ``folder/l{i}.json``)."""
    return [
        "--insecure", "--superlink", f"127.0.0.1:{port}",
        "--host", "127.0.0.1", "--port", str(free_port()),
        "--node-config", node_config(i, folder / f"l{i}.json"),
    ]  # fmt: skip


class Processes:
    """Processes started with their output in ``folder/<name>.log``."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env = folder, env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[str, Path] = {}

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        """Start ``command`` as ``name``."""
        self.logs[name] = self.folder / f"{name}.log"
        with self.logs[name].open("w") as out:
            proc = subprocess.Popen(
                command, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """Terminate every process, newest first; kill what does not stop."""
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def superlink_command(port: int, health: int, *security: str) -> list[str]:
    """``flower-superlink`` on 127.0.0.1:``port`` (``--insecure`` by default)."""
    return [
        str(BIN / "flower-superlink"), *(security or ("--insecure",)),
        "--disable-runtime-dependency-installation",
        "--host", "127.0.0.1", "--port", str(port),
        "--health-server-address", f"127.0.0.1:{health}",
    ]  # fmt: skip


class Deployment(NamedTuple):
    """What a test needs of a running deployment."""

    env: dict[str, str]
    """The environment for ``flwr run`` / ``defense_suite.federated run``."""
    logs: list[Path]
    """The SuperNodes' log files."""
    port: int
    """The SuperLink's Fleet API port on 127.0.0.1."""


@contextlib.contextmanager
def insecure_deployment(
    folder: Path,
    supernode: Callable[[int, int], list[str]],
    nodes: int = 2,
    **extra_env: str,
) -> Iterator[Deployment]:
    """An insecure SuperLink and ``nodes`` SuperNodes on loopback.

    ``supernode(i, port)`` is SuperNode ``i``'s command line. Yields the
    :class:`Deployment`; stops every process on leaving.
    """
    port, health = free_port(), free_port()
    env = flower_env(superlink_home(folder, port), **extra_env)
    procs = Processes(folder, env)
    try:
        procs.start("superlink", superlink_command(port, health))
        time.sleep(8)
        for i in range(nodes):
            procs.start(f"supernode{i}", supernode(i, port))
        logs = [procs.logs[f"supernode{i}"] for i in range(nodes)]
        yield Deployment(env, logs, port)
    finally:
        procs.stop()


def example_run(
    env: dict[str, str],
    app: Path = EXAMPLE,
    config: str = "num-server-rounds=3",
    timeout: int = 600,
    superlink: str | None = "test",
) -> subprocess.CompletedProcess[str]:
    """``python -m defense_suite.federated run APP SUPERLINK --run-config CONFIG``
    (``superlink=None``: the home's default, e.g. :func:`simulation_home`'s)."""
    named = [] if superlink is None else [superlink]
    return subprocess.run(
        [sys.executable, "-m", "defense_suite.federated", "run", str(app), *named,
         "--run-config", config],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


class Simulation(NamedTuple):
    """A local simulation the entry point runs (:func:`entry_point_simulation`)."""

    env: dict[str, str]
    """The environment of ``python -m defense_suite.federated run``."""
    result: Path
    """Where the ServerApp writes the run's summary."""

    def completed(
        self, app: Path, timeout: int, config: str = "num-server-rounds=2"
    ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
        """Run ``app`` on the home's default SuperLink; it must exit 0. Returns the
        process and the summary it wrote."""
        run = example_run(self.env, app, config, timeout, superlink=None)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        return run, json.loads(self.result.read_text())


@contextlib.contextmanager
def entry_point_simulation(folder: Path, port: int) -> Iterator[Simulation]:
    """Three SuperNodes in local simulation (:func:`simulation_env` on ``port``), the
    summary at ``folder/result.json``. On leaving without an error, asserts that the
    entry point stopped the local SuperLink ``flwr run`` started (any left is
    stopped either way)."""
    result = folder / "result.json"
    env = simulation_env(folder, 3, port, FEDERATED_RESULT_PATH=str(result))
    try:
        yield Simulation(env, result)
    finally:
        left = left_running(env)
    assert left == [], f"local SuperLinks left running: {left}"


def assert_unsigned_fab_refused(
    folder: Path,
    supernode: Callable[[int, int], list[str]],
    during: Callable[[Deployment], None] | None = None,
) -> None:
    """SuperNodes started by ``supernode`` (with ``--trusted-entities``) refuse the
    FAB of a local run: the run fails, the SuperNodes log Flower's refusal, and no
    ledger exists (no ClientApp code ran). ``during`` runs first, deployment up."""
    with insecure_deployment(folder, supernode) as deployment:
        if during is not None:
            during(deployment)
        run = example_run(deployment.env)
        assert run.returncode == 1, run.stdout[-3000:]
        text = " ".join(p.read_text(errors="replace") for p in deployment.logs)
    assert "App verification is not supported by the connected SuperLink" in text
    assert not list(folder.glob("l*.json"))  # no ClientApp code ever ran
