"""Test options.

Slow tests are skipped unless ``--runslow`` is given.

Hypothesis profiles make the verdict of a run a function of the code alone where it
has to be: ``ci`` (chosen when ``CI`` is set, as ``.ci/run`` is run) derandomizes every
property test (each test's examples are drawn from a seed derived from the test
itself), keeps no example database and imposes no deadline, so two CI runs of the same
commit give the same verdict. Local runs use ``dev`` (fresh random examples every run,
so exploration goes on); ``explore`` draws ten times as many examples for a
nightly-style run (``make test-explore``). ``HYPOTHESIS_PROFILE`` names a profile
explicitly.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from defenses.testing import SLOW_ENV

settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("dev", deadline=None)
settings.register_profile("explore", deadline=None, max_examples=1000)


def _profile() -> str:
    """The hypothesis profile for this run: explicit, else ``ci`` under CI."""
    explicit = os.environ.get("HYPOTHESIS_PROFILE")
    if explicit:
        return explicit
    ci = os.environ.get("CI", "").strip().lower()
    return "ci" if ci not in ("", "0", "false", "no") else "dev"


settings.load_profile(_profile())


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--runslow", action="store_true", default=False, help="run slow tests"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis profile: {settings.get_current_profile_name()}"


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
