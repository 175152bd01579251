import dataclasses
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from defense_suite.federated.flower.app import client_app, make_client_app, server_app
from defense_suite.federated.flower.config import AppConfig, key_of
from defense_suite.federated.flower.run import plan, run_in_process, run_simulation
from defense_suite.federated.flower.strategy import ClientFailure
from tests.federated.loopback import LoopbackGrid, node_contexts

REPO = Path(__file__).resolve().parents[2]
CONFIG = AppConfig(n_clients=3, rounds=4, min_nodes=3)


pytestmark = pytest.mark.usefixtures("task_identity", "simulated")


def serve_over_loopback(config, tmp_path, seeded=True, **node):
    """The real ServerApp against the real ClientApp, messages passed in-process.

    ``seeded``: every node opts into the research seed (simulation only), so the
    run can be compared with the in-process one bit for bit.
    """
    path = tmp_path / "result.json"
    run_config = dataclasses.replace(config, result_path=str(path)).record()
    if seeded:
        node = {
            str(i): {"research-seed": config.seed, **node.get(str(i), {})}
            for i in range(config.n_clients)
        }
    grid = LoopbackGrid(client_app, node_contexts(config.n_clients, run_config, **node))
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    server_app(grid, context)
    return json.loads(path.read_text()), grid


def test_server_app_reproduces_the_in_process_run(tmp_path):
    summary, grid = serve_over_loopback(CONFIG, tmp_path)
    reference = run_in_process(CONFIG)
    assert summary["status"] == "completed"
    np.testing.assert_allclose(summary["curve"], reference.curve, atol=1e-12)
    assert summary["epsilons"] == pytest.approx(reference.epsilons, rel=1e-12)
    assert summary["budgets"] == reference.budgets == [1.0, 3.0, 8.0]
    for eps, budget in zip(reference.epsilons, reference.budgets, strict=True):
        assert 0.99 * budget <= eps <= budget
    # per-client summary: own epsilon, budget; no accuracy on private data
    assert [row["client"] for row in summary["clients"]] == ["0", "1", "2"]
    assert all(row["accuracy"] is None for row in summary["clients"])
    assert not [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert not any(r.has_error() for r in grid.replies)


def test_honest_proposal_is_exactly_the_clients_own_schedule(tmp_path):
    _, grid = serve_over_loopback(CONFIG, tmp_path)
    schedules = plan(CONFIG)
    for msg in grid.sent:
        if msg.metadata.message_type != "train":
            continue
        pid = msg.metadata.dst_node_id - 100
        cfg = msg.content["config"]
        own = schedules[pid].rounds[cfg["dp-round"] - 1]
        assert (cfg["dp-rate"], cfg["dp-sigma"], cfg["dp-steps"]) == (
            own.rate,
            own.sigma,
            own.steps,
        )
        # the server sends no budget: the client's comes from its own side
        assert not {"budgets", "epsilon", "delta"} & set(cfg.keys())


def test_node_config_budget_overrides_the_run_config_stand_in(tmp_path):
    node = {"0": {"epsilon": 2.0}, "1": {"epsilon": 2.0}, "2": {"epsilon": 2.0}}
    summary, _ = serve_over_loopback(CONFIG, tmp_path, **node)
    assert summary["budgets"] == [2.0, 2.0, 2.0]
    assert all(0.99 * 2.0 <= e <= 2.0 for e in summary["epsilons"])


def test_in_process_run_is_deterministic():
    a, b = run_in_process(CONFIG), run_in_process(CONFIG)
    assert a.curve == b.curve
    other = run_in_process(dataclasses.replace(CONFIG, seed=1))
    assert other.curve != a.curve


def test_node_without_partition_is_refused(tmp_path, caplog):
    grid = LoopbackGrid(make_client_app(CONFIG), node_contexts(1))
    grid.contexts[100].node_config.clear()
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(),
        run_config=dataclasses.replace(CONFIG, min_nodes=1).record(),
    )  # fmt: skip
    with pytest.raises(Exception, match="refused: node-config"):
        server_app(grid, context)
    # the details stay in the node's own log
    assert any("partition-id" in r.getMessage() for r in caplog.records)


def _declared():
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["flwr"]["app"]["config"]


def test_every_config_field_is_declared_in_pyproject():
    declared = _declared()
    fields = {key_of(f.name) for f in dataclasses.fields(AppConfig)}
    assert set(declared) == fields
    assert AppConfig.from_mapping(declared) == AppConfig(rounds=5)


BAD = {
    "num-server-rounds": [2.7, True, 0, "3"],
    "dataset": ["mnist", 1],
    "n-clients": [0, 1.5],
    "alpha": [0.0, -1.0, "x", float("nan")],
    "policy": ["greedy"],
    "budgets": ["1;2", 1.0, "1,-3,8", ""],
    "group-fractions": ["0.5,0.6,0.3", "1", "a,b,c"],
    "delta": [0.0, 1.0, True],
    "member-fraction": [1.0, 0.0],
    "sigma": [0.0, -1.0, float("inf")],
    "save-fraction": [0.0, 1.0],
    "save-ratio": [0.0, 1.5],
    "local-steps": [0, 2.0],
    "lr": [0.0, "fast"],
    "clip": [-1.0],
    "model": ["cnn", "MLP", "nope"],
    "hidden": [0],
    "batch-rate": [0.0, 1.5],
    "dp-wrapper": ["yes", 1, "true"],
    "clipping-norm": [0.0],
    "seed": [True, -1, 1.0],
    "min-nodes": [0],
    "timeout": [0.0],
    "result-path": [3],
}


def test_a_bad_value_of_every_key_is_refused_naming_it():
    assert set(BAD) == set(_declared())
    for key, values in BAD.items():
        for value in values:
            with pytest.raises((ValueError, TypeError), match=f"'?{key}"):
                AppConfig.from_mapping({key: value})
    with pytest.raises(ValueError, match="unknown app config key 'epochs'"):
        AppConfig.from_mapping({"epochs": 3})
    with pytest.raises(ValueError, match="dp-wrapper"):
        AppConfig(dp_wrapper=True)


def test_config_round_trips_and_accepts_field_names():
    config = AppConfig.from_mapping(
        {"num-server-rounds": 7, "budgets": "2, 4", "group-fractions": "0.5,0.5"}
    )
    assert (config.rounds, config.budgets) == (7, (2.0, 4.0))
    assert AppConfig.from_mapping(config.record()) == config
    assert AppConfig.from_mapping({"rounds": 7, "n_clients": 3}).n_clients == 3


def test_bad_budget_fails_before_the_simulation_starts():
    with pytest.raises(ValueError, match="budgets"):
        run_simulation(dataclasses.replace(CONFIG, budgets=(1.0, -3.0, 8.0)))
    with pytest.raises(ValueError, match="budget"):
        run_simulation(dataclasses.replace(CONFIG, sigma=50.0, budgets=(1.0, 3.0, 8.0)))


@pytest.mark.slow
def test_flower_simulation_matches_in_process(node_storage):
    config = dataclasses.replace(CONFIG, rounds=3)
    flower = run_simulation(config, research_seed=config.seed)
    reference = run_in_process(config)
    assert len(flower.curve) == config.rounds
    assert flower.curve == pytest.approx(reference.curve)
    assert flower.epsilons == pytest.approx(reference.epsilons)
    # the simulated nodes' lifetime ledgers are on disk (inherited by Ray's actors)
    assert sorted(p.name for p in node_storage.glob("*.json")) == [
        f"ledger-partition-{i}.json" for i in range(config.n_clients)
    ]
    # and they remember: a second run on the same records is refused
    with pytest.raises(ClientFailure, match="refused: over-budget"):
        run_simulation(config, research_seed=config.seed)
