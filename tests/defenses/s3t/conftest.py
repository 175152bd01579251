from __future__ import annotations

import pytest

from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture
from tests.tiny_digits import TinyDigits, tiny_digits


@pytest.fixture(scope="session")
def tiny() -> TinyDigits:
    return tiny_digits(public=150, pool=180, test=150)


@pytest.fixture
def fast() -> dict[str, int]:
    """Training settings of the tiny models."""
    return {"epochs": 2, "batch_size": 32, "rank": 2}
