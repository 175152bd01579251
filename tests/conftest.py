"""Test options: slow tests are skipped unless ``--runslow`` is given."""

from __future__ import annotations

import os

import pytest

from defenses.testing import SLOW_ENV


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--runslow", action="store_true", default=False, help="run slow tests"
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if config.getoption("--runslow"):
        os.environ[SLOW_ENV] = "1"
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
