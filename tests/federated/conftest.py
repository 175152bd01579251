"""Fixtures shared by the federated tests that build Flower messages."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture
def task_identity():
    """Give messages built outside a Flower runtime a task identity, then restore."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
