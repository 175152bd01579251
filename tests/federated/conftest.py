"""Fixtures shared by the federated tests that build Flower messages."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def node_storage(tmp_path, monkeypatch):
    """Every test's nodes keep their lifetime ledgers in a folder of their own."""
    folder = tmp_path / "node-state"
    monkeypatch.setenv("DEFENSE_SUITE_STATE_DIR", str(folder))
    monkeypatch.delenv("DEFENSE_SUITE_RESEARCH_SEED", raising=False)
    return folder


@pytest.fixture
def simulated(monkeypatch):
    """Run in-process ClientApps as Flower's simulation would (a Ray actor).

    The loopback transport calls the ClientApp in this process; this fixture makes
    :func:`federated.flower.runtime.in_simulation` answer as it does inside Flower's
    simulation actors, where the run config may stand in for node configs.
    """
    from defense_suite.federated.flower import runtime

    monkeypatch.setattr(runtime, "in_simulation", lambda: True)


@pytest.fixture
def task_identity():
    """Give messages built outside a Flower runtime a task identity, then restore."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
