"""One torch thread for the torch-heavy test packages (rps, s3t, civet, composition).

A conftest imports :func:`one_torch_thread` to make it autouse for its folder: the
tests train many tiny models, for which one thread is fastest and keeps the two CI
cores from oversubscribing. The setting is restored after each module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from defenses.threads import torch_threads


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run the module's tests with one torch thread."""
    with torch_threads(1):
        yield
