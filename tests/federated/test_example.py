"""examples/flower-own-model: a user's CNN and data with the three public pieces."""

import json
import sys
import tomllib
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from tests.federated.loopback import LoopbackGrid, node_contexts
from tests.federated.superlink import entry_point_simulation

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower-own-model"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    from own_model import client_app, server_app

    yield client_app.app, server_app.app
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    for name in [m for m in sys.modules if m.startswith("own_model")]:
        del sys.modules[name]


def run_config(**changes):
    with open(EXAMPLE / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    return {**config, **changes}


def test_the_example_trains_its_cnn_with_three_privacy_groups(
    example, tmp_path, monkeypatch, simulated
):
    client, server = example
    result = tmp_path / "result.json"
    monkeypatch.setenv("FEDERATED_RESULT_PATH", str(result))
    config = run_config(**{"num-server-rounds": 2})
    grid = LoopbackGrid(client, node_contexts(3, config))
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config
    )
    server(grid, context)
    summary = json.loads(result.read_text())
    assert [row["budget"] for row in summary["clients"]] == [1.0, 3.0, 8.0]
    for row in summary["clients"]:
        assert 0.99 * row["budget"] <= row["epsilon"] <= row["budget"]
        assert 0.0 <= row["accuracy"] <= 1.0
    assert not any(r.has_error() for r in grid.replies)


def test_the_example_uses_only_the_public_api():
    for path in (EXAMPLE / "own_model").glob("*.py"):
        for line in path.read_text().splitlines():
            if "defense_suite" in line and "import" in line:
                assert line.startswith("from defense_suite.federated.flower import")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_example_runs_with_flwr_run_in_simulation(tmp_path):
    with entry_point_simulation(tmp_path, 39391) as simulation:
        _, summary = simulation.completed(EXAMPLE, 1500)
    assert [r["budget"] for r in summary["clients"]] == [1.0, 3.0, 8.0]
