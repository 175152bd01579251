"""``python -m defense_suite.federated``: validated first, an honest exit code."""

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from defense_suite.federated.__main__ import main
from tests.federated.superlink import (
    entry_point_simulation,
    example_run,
    left_running,
    simulation_env,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model='cnn'", "model"),
        ("num-server-rounds=2.7", "num-server-rounds"),
        ("dp-wrapper='yes'", "dp-wrapper"),
        ("seed=true", "seed"),
        ("budgets='1,2'", "group-fractions"),
        ("epochs=3", "epochs"),
        ("sigma=50.0", "budget"),
    ],
)
def test_a_bad_config_exits_2_naming_the_key(override, named, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    assert main(["run", str(REPO), "--run-config", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert named in err
    assert started == []  # no flwr process, no SuperLink


def test_a_missing_app_exits_2(tmp_path, capsys):
    assert main(["run", str(tmp_path)]) == 2
    assert "no pyproject.toml" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_flwr_run_through_the_entry_point_completes_or_fails_honestly(tmp_path):
    with entry_point_simulation(tmp_path, 39291) as simulation:
        ok, summary = simulation.completed(REPO, 500)
        assert "finished:completed" in ok.stdout
        assert "uv sync" not in ok.stdout
        assert "Installing application dependencies" not in ok.stdout
        assert summary["status"] == "completed"
        assert summary["budgets"] == [1.0, 3.0, 8.0]
        for e, b in zip(summary["epsilons"], summary["budgets"], strict=True):
            assert 0.99 * b <= e <= b
        assert "round 2: client 2 spent epsilon" in ok.stdout
        # a run that fails inside the ServerApp: flwr run exits 0, we do not
        missing = f"result-path='{tmp_path}/missing/dir/r.json'"
        bad = example_run(
            simulation.env, REPO, f"num-server-rounds=2 {missing}", 500, superlink=None
        )
        assert bad.returncode == 1, bad.stdout[-3000:]
        assert "finished:failed" in bad.stdout


FAKE_SUPERLINK = """import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_the_entry_point_stops_the_local_superlink_it_started(tmp_path):
    """A detached process named and argued as `flwr run` starts its SuperLink."""
    from defense_suite.federated.__main__ import (
        local_superlink_pids,
        stop_started_superlink,
        superlink_up,
    )

    script = tmp_path / "flower-superlink"
    script.write_text(FAKE_SUPERLINK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    assert not superlink_up(port)
    proc = subprocess.Popen(
        [sys.executable, str(script), "--insecure", "--simulation", "--port", port],
        start_new_session=True,
    )
    try:
        for _ in range(100):
            if superlink_up(port):
                break
            time.sleep(0.1)
        assert local_superlink_pids(port) == [proc.pid]
        # one that was already running before the command is not ours: kept
        assert stop_started_superlink(port, was_up=True) == []
        assert proc.poll() is None
        assert stop_started_superlink(port, was_up=False) == [proc.pid]
        assert proc.wait(timeout=20) == -signal.SIGTERM
        assert not superlink_up(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_uv_resolves_away_every_base_dependency_of_the_app_bundle():
    """`flwr run .` runs `uv sync` on this pyproject: each base dependency must be
    overridden out (a never-true marker), or a new one pulls its own build."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    names = {Requirement(d).name for d in project["project"]["dependencies"]}
    overrides = [Requirement(d) for d in project["tool"]["uv"]["override-dependencies"]]
    assert {o.name for o in overrides} == names
    for override in overrides:
        assert override.marker is not None
        assert not override.marker.evaluate()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_plain_flwr_run_installs_nothing(tmp_path):
    """The ordinary Flower command, without the variable that turns Flower's runtime
    installs off: its `uv sync` finds nothing to install and the run uses this
    environment."""
    env = simulation_env(
        tmp_path, 2, 39391, DEFENSE_SUITE_STATE_DIR=str(tmp_path / "ledgers")
    )
    env.pop("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", None)
    flwr = str(Path(sys.executable).parent / "flwr")
    try:
        done = subprocess.run(
            [flwr, "run", str(REPO), "--stream", "--run-config", "num-server-rounds=1"],
            env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-3000:]
        assert "No additional application dependencies needed installation" in out
        assert "Installed: [" not in out
    finally:
        left_running(env)
