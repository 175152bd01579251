from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from defenses.data import load_digits
from defenses.s3t.backbone import ResidualMLP, pretrain
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture


@dataclass(frozen=True)
class Tiny:
    backbone: ResidualMLP
    X: np.ndarray
    y: np.ndarray
    ids: np.ndarray
    test_X: np.ndarray
    test_y: np.ndarray


@pytest.fixture(scope="session")
def tiny() -> Tiny:
    data = load_digits()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(data))
    public, pool, test = order[:150], order[150:330], order[330:480]
    backbone = pretrain(
        data.X[public], data.y[public], rng, width=24, hidden=32, n_blocks=4, epochs=5
    )
    return Tiny(
        backbone,
        data.X[pool],
        data.y[pool],
        np.arange(1000, 1000 + pool.size),
        data.X[test],
        data.y[test],
    )


@pytest.fixture
def fast() -> dict[str, int]:
    """Training settings of the tiny models."""
    return {"epochs": 2, "batch_size": 32, "rank": 2}
