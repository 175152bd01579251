"""Issue 37 items 4 and 5: verified apps by default; a simulation one can rerun.

* ``python -m defense_suite.federated supernode`` starts ``flower-supernode`` only
  with ``--trusted-entities`` (or an explicit ``--allow-unverified-apps`` that says
  what such an app can do); with real SuperLink and SuperNodes, an unverified FAB
  is refused before any ClientApp code runs.
* ``python -m defense_suite.federated run`` of the package's app twice: with the
  simulation's own ledger both runs complete; with a ledger folder the user names,
  the second run's spent budget ends it with one line, no traceback, exit code 1.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from defense_suite.federated import __main__ as entry
from tests.federated.test_deployment import AGREEMENT, BUDGETS, EXAMPLE, _free_port
from tests.federated.test_main import REPO, _left_running, _simulation_home

BIN = Path(sys.executable).parent


def test_a_supernode_without_app_verification_does_not_start(capsys):
    assert entry.main(["supernode", "--insecure", "--superlink", "x:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: supernode: pass --trusted-entities FILE")
    assert err.count("\n") == 1


def test_the_suite_command_reaches_the_supernode_action():
    done = subprocess.run(
        [str(BIN / "defense-suite"), "federated", "supernode", "--insecure"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "pass --trusted-entities FILE" in done.stderr


def test_the_supernode_command_keeps_flowers_arguments():
    command = entry.supernode_command(
        ["--insecure", "--trusted-entities", "t.yaml"], False
    )
    assert Path(command[0]).name == "flower-supernode"
    assert command[1:] == ["--insecure", "--trusted-entities", "t.yaml"]


def test_opting_out_says_what_an_unverified_app_can_do(monkeypatch, capsys):
    calls = []

    def call(command, env):
        calls.append((command, env))
        return 0

    monkeypatch.setattr(entry.subprocess, "call", call)
    assert entry.main(["supernode", "--allow-unverified-apps", "--insecure"]) == 0
    (command, env), = calls  # fmt: skip
    assert command[1:] == ["--insecure"]
    assert env[entry.NO_INSTALL] == "1"
    err = capsys.readouterr().err
    for words in ("read the node's private records", "rewrite or delete the privacy"
                  " ledger", "fresh budget"):  # fmt: skip
        assert words in err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_supernodes_started_by_the_command_refuse_an_unverified_fab(tmp_path):
    """Real SuperLink, two SuperNodes through ``supernode --trusted-entities``: the
    local (unsigned) FAB is refused and no ClientApp code runs (no ledger)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate().public_key()
    openssh = key.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()
    trusted = tmp_path / "trusted.yaml"
    trusted.write_text(f'publisher-key: "{openssh}"\n')
    home = tmp_path / "home"
    home.mkdir()
    port, health = _free_port(), _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        out = (tmp_path / "superlink.log").open("w")
        procs.append(subprocess.Popen([
            str(BIN / "flower-superlink"), "--insecure",
            "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1", "--port", str(port),
            "--health-server-address", f"127.0.0.1:{health}",
        ], env=env, stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
        time.sleep(8)
        for i in range(2):
            logs.append(tmp_path / f"supernode{i}.log")
            out = logs[-1].open("w")
            procs.append(subprocess.Popen([
                sys.executable, "-m", "defense_suite.federated", "supernode",
                "--insecure", "--superlink", f"127.0.0.1:{port}",
                "--host", "127.0.0.1", "--port", str(_free_port()),
                "--trusted-entities", str(trusted),
                "--node-config",
                f"partition-id={i} num-partitions=3 epsilon={BUDGETS[i]} "
                f'{AGREEMENT} ledger-init=true ledger-path="{tmp_path}/l{i}.json"',
            ], env=env, stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
        unverified = subprocess.run(
            [sys.executable, "-m", "defense_suite.federated", "supernode",
             "--insecure", "--superlink", f"127.0.0.1:{port}"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert unverified.returncode == 2
        run = subprocess.run(
            [sys.executable, "-m", "defense_suite.federated", "run", str(EXAMPLE),
             "test", "--run-config", "num-server-rounds=3"],
            env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert run.returncode == 1, run.stdout[-3000:]
        text = " ".join(p.read_text(errors="replace") for p in logs)
        assert "App verification is not supported by the connected SuperLink" in text
        assert not list(tmp_path.glob("l*.json"))  # no ClientApp code ever ran
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _run_twice(tmp_path, env):
    command = [sys.executable, "-m", "defense_suite.federated", "run", str(REPO),
               "--run-config", "num-server-rounds=2 budgets='1.0' "
               "group-fractions='1.0'"]  # fmt: skip
    return [
        subprocess.run(
            command,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        for _ in range(2)
    ]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_same_simulation_runs_twice_and_a_spent_budget_ends_in_one_line(
    tmp_path,
):
    env = {
        **os.environ,
        "FLWR_HOME": str(_simulation_home(tmp_path, 2)),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39491",
        "FLWR_LOCAL_CONTROL_API_PORT": "39493",
        "XDG_STATE_HOME": str(tmp_path / "state"),
    }
    env.pop("DEFENSE_SUITE_STATE_DIR", None)
    try:
        scoped = _run_twice(tmp_path, env)  # the simulation's own ledgers
        for done in scoped:
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        runs = list((tmp_path / "state").glob("defense-suite/federated/simulations/*"))
        assert len(runs) == 2
        env["DEFENSE_SUITE_STATE_DIR"] = str(tmp_path / "named")  # the user's folder
        first, second = _run_twice(tmp_path, env)
    finally:
        _left_running(env)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    out = second.stdout + second.stderr
    assert second.returncode == 1, out[-3000:]
    stopped = [line for line in out.splitlines() if "run stopped:" in line]
    assert len(stopped) == 1, out[-3000:]
    assert "refused: over-budget (spent epsilon " in stopped[0]
    assert " of budget 1)" in stopped[0]
    assert "client " in stopped[0]
    assert "Traceback" not in out
