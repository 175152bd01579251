"""Issue 37 items 4 and 5: verified apps by default; a simulation one can rerun.

* ``python -m defense_suite.federated supernode`` starts ``flower-supernode`` only
  with ``--trusted-entities`` (or an explicit ``--allow-unverified-apps`` that says
  what such an app can do); with real SuperLink and SuperNodes, an unverified FAB
  is refused before any ClientApp code runs.
* ``python -m defense_suite.federated run`` of the package's app twice: with the
  simulation's own ledger both runs complete; with a ledger folder the user names,
  the second run's spent budget ends it with one line, no traceback, exit code 1.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from defense_suite.federated import __main__ as entry
from tests.federated.superlink import (
    BIN,
    REPO,
    assert_unsigned_fab_refused,
    left_running,
    simulation_env,
    supernode_args,
    trusted_entities,
)


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
    trusted = trusted_entities(tmp_path)

    def supernode(i, port):
        return [sys.executable, "-m", "defense_suite.federated", "supernode",
                *supernode_args(i, port, tmp_path),
                "--trusted-entities", str(trusted)]  # fmt: skip

    def unverified_does_not_start(deployment):
        unverified = subprocess.run(
            [sys.executable, "-m", "defense_suite.federated", "supernode",
             "--insecure", "--superlink", f"127.0.0.1:{deployment.port}"],
            env=deployment.env, capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip
        assert unverified.returncode == 2

    assert_unsigned_fab_refused(tmp_path, supernode, unverified_does_not_start)


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
    env = simulation_env(tmp_path, 2, 39491, XDG_STATE_HOME=str(tmp_path / "state"))
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
        left_running(env)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    out = second.stdout + second.stderr
    assert second.returncode == 1, out[-3000:]
    stopped = [line for line in out.splitlines() if "run stopped:" in line]
    assert len(stopped) == 1, out[-3000:]
    assert "refused: over-budget (spent epsilon " in stopped[0]
    assert " of budget 1)" in stopped[0]
    assert "client " in stopped[0]
    assert "Traceback" not in out
