"""``python -m defense_suite.federated run|supernode ...``.

``supernode [--allow-unverified-apps] FLOWER-SUPERNODE-ARGS...`` starts
``flower-supernode`` with app verification as the default path: it refuses to
start (exit code 2, one ``error:`` line) unless the arguments include
``--trusted-entities FILE`` (Flower then runs only FABs signed by a trusted
publisher and verified through the SuperLink), or the operator opts out with
``--allow-unverified-apps``, which prints what an unverified ClientApp can do on
the node (:data:`UNVERIFIED`). Runtime dependency installation is disabled.

``run [APP] [CONNECTION] [--run-config ...]``:

A wrapper around ``flwr run`` for scripts. Before anything starts it reads the app's
``[tool.flwr.app.config]``, applies the ``--run-config`` overrides (Flower's own
parser) and, for this package's app, validates every value and solves every
client's schedule: a bad key or value fails in well under a second with one
``error:`` line naming it and exit code 2. Then it runs ``flwr run APP [CONNECTION]
--stream`` with runtime dependency installation disabled (no ``uv sync``, nothing
downloaded: the SuperLink it starts uses the environment this command runs in; a
local simulation SuperLink gets its own ports, 39191 and 39193 unless
``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``/``FLWR_LOCAL_CONTROL_API_PORT`` are set, so
one started earlier with installation enabled is never reused), and finally asks
``flwr ls`` for the run's status: the exit code is 0 only when it is
``finished:completed`` (``flwr run`` itself exits 0 for a failed run). It stops what
it started: a local SuperLink that was not answering on its port before the run and
is after it (``flwr run`` starts one detached and leaves it running) is sent
SIGTERM, with its process group, once the status is read.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

OWN_APP = "federated.flower.app:server_app"
LOCAL_PORTS = {
    "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39191",
    "FLWR_LOCAL_CONTROL_API_PORT": "39193",
}
NO_INSTALL = "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"
COMPLETED = "finished:completed"


UNVERIFIED = (
    "warning: this SuperNode runs any ClientApp a SuperLink sends (no "
    "--trusted-entities). That code runs with the node's rights: it can read the "
    "node's private records, send them in its replies, and rewrite or delete the "
    "privacy ledger (no key can be hidden from it: the ledger's own code runs in "
    "the same process), after which an honest run gets a fresh budget. The "
    "defense-suite guarantees hold only for ClientApp code the node trusts."
)
"""What an unverified app can do (printed by ``supernode --allow-unverified-apps``)."""
TRUSTED = "--trusted-entities"
ALLOW_UNVERIFIED = "--allow-unverified-apps"


class UsageError(ValueError):
    """A bad app directory, override or config value: exit code 2."""


def parser() -> argparse.ArgumentParser:
    """The command line (``run`` is the only command)."""
    p = argparse.ArgumentParser(
        prog="python -m defense_suite.federated",
        description="Run a Flower app with flwr run, validated first; the exit code "
        "is 0 only if the run's final status is finished:completed.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="validate, run with flwr run, check the status")
    run.add_argument("app", nargs="?", default=".", help="app directory (default .)")
    run.add_argument("connection", nargs="?", help="SuperLink connection name")
    run.add_argument(
        "--run-config",
        action="append",
        default=None,
        help='overrides, e.g. "num-server-rounds=3 sigma=2.0" (as for flwr run)',
    )
    node = sub.add_parser(
        "supernode",
        help="flower-supernode with app verification (--trusted-entities) required",
    )
    node.add_argument(
        ALLOW_UNVERIFIED,
        action="store_true",
        help="start without --trusted-entities (prints what such an app can do)",
    )
    node.add_argument("rest", nargs=argparse.REMAINDER, help="flower-supernode args")
    return p


def supernode_command(rest: list[str], allow_unverified: bool) -> list[str]:
    """The ``flower-supernode`` command line, or UsageError without verification."""
    verified = any(a == TRUSTED or a.startswith(TRUSTED + "=") for a in rest)
    if not verified and not allow_unverified:
        raise UsageError(
            f"supernode: pass {TRUSTED} FILE (only signed, verified apps run on "
            f"this node) or, knowing what an unverified app can do, {ALLOW_UNVERIFIED}"
        )
    return [str(Path(sys.executable).parent / "flower-supernode"), *rest]


def supernode(rest: list[str], allow_unverified: bool) -> int:
    """Run ``flower-supernode`` (verification required unless opted out)."""
    try:
        command = supernode_command(rest, allow_unverified)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if allow_unverified and TRUSTED not in " ".join(rest):  # the one line that says it
        print(UNVERIFIED, file=sys.stderr)
    env = {**os.environ, NO_INSTALL: "1"}
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    return subprocess.call(command, env=env)


def app_config(app: Path, overrides: list[str] | None) -> tuple[dict[str, Any], str]:
    """The app's run config with the overrides applied, and its ServerApp."""
    from flwr.common.config import parse_config_args

    project = app / "pyproject.toml"
    if not project.is_file():
        raise UsageError(f"{project}: no pyproject.toml in the app directory")
    with project.open("rb") as f:
        flwr = tomllib.load(f).get("tool", {}).get("flwr", {}).get("app", {})
    try:
        server = str(flwr["components"]["serverapp"])
    except KeyError:
        raise UsageError(
            f"{project}: no [tool.flwr.app.components] serverapp"
        ) from None
    declared = dict(flwr.get("config", {}))
    try:
        changes = parse_config_args(overrides)
    except ValueError as error:
        raise UsageError(f"--run-config: {error}") from None
    unknown = sorted(set(changes) - set(declared))
    if unknown:
        raise UsageError(
            f"--run-config: key(s) {unknown} are not declared in "
            f"[tool.flwr.app.config] of {project}"
        )
    return {**declared, **changes}, server


def validate(values: dict[str, Any], server: str) -> None:
    """Check this package's app config and solve every schedule (others: nothing)."""
    if server.removeprefix("defense_suite.") != OWN_APP:
        return
    from .flower.config import AppConfig
    from .flower.run import plan

    try:
        plan(AppConfig.from_mapping(values))
    except (TypeError, ValueError) as error:
        raise UsageError(f"run config: {error}") from None


def environment() -> dict[str, str]:
    """The environment of ``flwr run``: no runtime installs, own local ports."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, NO_INSTALL: "1"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    for key, port in LOCAL_PORTS.items():
        env.setdefault(key, port)
    return env


def flwr(*args: str) -> list[str]:
    """A ``flwr`` command line (the executable beside this interpreter)."""
    return [str(Path(sys.executable).parent / "flwr"), *args]


def stream_run(command: list[str], env: dict[str, str]) -> tuple[int, int | None]:
    """Run ``flwr run --stream``, echo its output, return (exit code, run id)."""
    run_id = None
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            found = re.search(r"Successfully started run (\d+)", line)
            if found and run_id is None:
                run_id = int(found.group(1))
        code = proc.wait()
    return code, run_id


def run_status(run_id: int, connection: str | None, env: dict[str, str]) -> str:
    """The run's status text from ``flwr ls --format json``."""
    args = ["ls", *([connection] if connection else []), "--run-id", str(run_id)]
    done = subprocess.run(
        flwr(*args, "--format", "json"),
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    start = done.stdout.find("{")
    try:
        runs = json.loads(done.stdout[start:])["runs"]
        return str(runs[0]["status"])
    except (ValueError, KeyError, IndexError):
        return f"unknown ({done.stdout.strip()[-200:]} {done.stderr.strip()[-200:]})"


def superlink_up(port: str) -> bool:
    """Whether a local SuperLink answers its health check on ``port``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
            return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def local_superlink_pids(port: str) -> list[int]:
    """PIDs of ``flower-superlink --simulation ... --port PORT`` processes."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        named = any(Path(w).name == "flower-superlink" for w in words[:3])
        on_port = any(a == "--port" and b == port for a, b in itertools.pairwise(words))
        if named and on_port and "--simulation" in words:
            pids.append(int(entry.name))
    return pids


def stop_process(pid: int, grace: float = 15.0) -> None:
    """SIGTERM ``pid`` (its process group when it leads one), then SIGKILL."""
    try:
        group = os.getpgid(pid) == pid
        (os.killpg if group else os.kill)(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _zombie(pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (OSError, IndexError):
        return True


def stop_started_superlink(port: str, was_up: bool) -> list[int]:
    """Stop the local SuperLink on ``port`` if this command started it."""
    if was_up or not superlink_up(port):
        return []
    pids = local_superlink_pids(port)
    for pid in pids:
        logger.info("stopping the local SuperLink this run started (pid %d)", pid)
        stop_process(pid)
    return pids


def main(argv: Sequence[str] | None = None) -> int:
    """Validate, run, check the final status; return the exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["supernode"] and not {"-h", "--help"} & set(words):
        rest = [a for a in words[1:] if a != ALLOW_UNVERIFIED]
        return supernode(rest, ALLOW_UNVERIFIED in words[1:])
    args = parser().parse_args(words)
    app = Path(args.app)
    try:
        values, server = app_config(app, args.run_config)
        validate(values, server)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    env = environment()
    command = flwr("run", str(app), *([args.connection] if args.connection else []))
    command.append("--stream")
    for override in args.run_config or []:
        command += ["--run-config", override]
    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    was_up = superlink_up(port)
    try:
        code, run_id = stream_run(command, env)
        if run_id is None:
            print(f"error: flwr run did not start a run (exit {code})", file=sys.stderr)
            return code or 1
        status = run_status(run_id, args.connection, env)
        print(f"run {run_id}: {status}")
        return 0 if status == COMPLETED else 1
    finally:
        stop_started_superlink(port, was_up)


if __name__ == "__main__":
    sys.exit(main())
