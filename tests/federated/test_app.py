import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from federated.app import (
    AppConfig,
    ClientFailure,
    ScheduledFedAvg,
    build_task,
    client_app,
    initial_params,
    plan,
    run_in_process,
    run_simulation,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = AppConfig(n_clients=3, rounds=4)


@pytest.fixture(autouse=True)
def task_identity():
    # Messages built outside a Flower runtime need a task identity.
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _contexts(n):
    return {
        100 + i: Context(
            run_id=1,
            node_id=100 + i,
            node_config={"partition-id": i, "num-partitions": n},
            state=RecordDict(),
            run_config={},
        )
        for i in range(n)
    }


def _flower_rounds(config):
    """Drive the real strategy and ClientApp in-process, message by message."""
    contexts = _contexts(config.n_clients)
    task = build_task(config)
    strategy = ScheduledFedAvg(
        config, {k: i for i, k in enumerate(contexts)}, plan(config, task)
    )
    arrays = ArrayRecord(initial_params(config, task))
    for rnd in range(1, config.rounds + 1):
        messages = strategy.configure_train(rnd, arrays, ConfigRecord(), None)
        replies = [client_app(m, contexts[m.metadata.dst_node_id]) for m in messages]
        arrays, _ = strategy.aggregate_train(rnd, replies)
    return arrays.to_numpy_ndarrays(), strategy.spent


def test_flower_messages_reproduce_the_in_process_run():
    params, spent = _flower_rounds(CONFIG)
    reference = run_in_process(CONFIG)
    for a, b in zip(params, reference.params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert [spent[i] for i in range(3)] == pytest.approx(reference.epsilons)
    for eps, budget in zip(reference.epsilons, reference.budgets, strict=True):
        assert 0.99 * budget <= eps <= budget


def test_in_process_run_is_deterministic():
    a, b = run_in_process(CONFIG), run_in_process(CONFIG)
    assert a.curve == b.curve
    other = run_in_process(dataclasses.replace(CONFIG, seed=1))
    assert other.curve != a.curve


def test_client_error_and_missing_reply_fail_loudly():
    contexts = _contexts(2)
    config = dataclasses.replace(CONFIG, n_clients=2)
    task = build_task(config)
    strategy = ScheduledFedAvg(config, {100: 0, 101: 1}, plan(config, task))
    arrays = ArrayRecord(initial_params(config, task))
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), None))
    good = client_app(messages[0], contexts[100])
    bad = Message(Error(code=0, reason="client exploded"), reply_to=messages[1])
    with pytest.raises(ClientFailure, match="client exploded"):
        strategy.aggregate_train(1, [good, bad])
    with pytest.raises(ClientFailure, match="1 replies from 2 clients"):
        strategy.aggregate_train(1, [good])


def test_node_without_partition_is_refused():
    config = dataclasses.replace(CONFIG, n_clients=2)
    task = build_task(config)
    strategy = ScheduledFedAvg(config, {100: 0, 101: 1}, plan(config, task))
    arrays = ArrayRecord(initial_params(config, task))
    message = next(iter(strategy.configure_train(1, arrays, ConfigRecord(), None)))
    context = Context(
        run_id=1, node_id=100, node_config={}, state=RecordDict(), run_config={}
    )
    with pytest.raises(Exception, match="partition-id"):
        client_app(message, context)


def test_app_config_parsing_and_errors():
    config = AppConfig.from_mapping(
        {
            "num-server-rounds": 7,
            "budgets": "2, 4",
            "group-fractions": "0.5,0.5",
            "dp-wrapper": False,
            "save-ratio": 0.6,
        }
    )
    assert (config.rounds, config.budgets, config.save_ratio) == (7, (2.0, 4.0), 0.6)
    assert AppConfig.from_mapping(config.record()) == config
    with pytest.raises(ValueError, match="unknown app config key 'epochs'"):
        AppConfig.from_mapping({"epochs": 3})
    with pytest.raises(ValueError, match="policy"):
        AppConfig(policy="greedy")
    with pytest.raises(ValueError, match="dp_wrapper"):
        AppConfig(dp_wrapper=True)
    with pytest.raises(ValueError, match="comma-separated"):
        AppConfig.from_mapping({"budgets": "1;2"})


def test_bad_budget_fails_before_the_simulation_starts():
    with pytest.raises(ValueError, match="budgets"):
        run_simulation(dataclasses.replace(CONFIG, budgets=(1.0, -3.0, 8.0)))
    with pytest.raises(ValueError, match="delta"):
        run_simulation(dataclasses.replace(CONFIG, delta=0.0))


@pytest.mark.slow
def test_flower_simulation_matches_in_process():
    config = dataclasses.replace(CONFIG, rounds=3)
    flower = run_simulation(config)
    reference = run_in_process(config)
    assert len(flower.curve) == config.rounds
    assert flower.curve == pytest.approx(reference.curve)
    assert flower.epsilons == pytest.approx(reference.epsilons)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_deployment_engine_on_loopback(tmp_path):
    """A SuperLink and two SuperNodes as separate processes run the same app."""
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "FLWR_HOME": str(tmp_path / "home"),
        "FLWR_TELEMETRY_ENABLED": "0",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    port, health = _free_port(), _free_port()
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    shutil.copy(REPO / "pyproject.toml", app_dir / "pyproject.toml")
    for package in ("defenses", "federated"):
        shutil.copytree(
            REPO / package,
            app_dir / package,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    result_path = tmp_path / "result.json"
    env["FEDERATED_RESULT_PATH"] = str(result_path)
    procs = [
        subprocess.Popen(
            [
                str(bin_dir / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--health-server-address",
                f"127.0.0.1:{health}",
                "--database",
                ":flwr-in-memory:",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        time.sleep(8)
        for i in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        str(bin_dir / "flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{port}",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(_free_port()),
                        "--node-config",
                        f"partition-id={i} num-partitions=2",
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        run = subprocess.run(
            [
                str(bin_dir / "flwr"),
                "run",
                str(app_dir),
                "test",
                "--stream",
                "--run-config",
                "num-server-rounds=2",
            ],
            env={**env, "FEDERATED_RESULT_PATH": str(result_path)},
            capture_output=True,
            text=True,
            timeout=500,
            check=False,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        import json

        summary = json.loads(result_path.read_text())
        assert len(summary["curve"]) == 2
        assert all(
            e <= b for e, b in zip(summary["epsilons"], summary["budgets"], strict=True)
        )
        assert "ERROR" not in run.stdout
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
