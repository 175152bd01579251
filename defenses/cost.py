"""Cost accounting: wall and CPU time per phase, and named counters.

Costs are recorded into the innermost :func:`recording` context through a
:class:`contextvars.ContextVar`, so library code can record sub-phases
(``with phase("unlearn"): ...``) or counters (``count("ciphertext_bytes", n)``)
without passing anything around; outside a recording both are no-ops.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from contextvars import ContextVar

_current: ContextVar[defaultdict[str, float] | None] = ContextVar(
    "defense_suite_cost", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[defaultdict[str, float]]:
    """Collect every :func:`phase` and :func:`count` made inside the block.

    On exit the process's peak resident memory is added as ``peak_rss_mb``.
    """
    costs: defaultdict[str, float] = defaultdict(float)
    token = _current.set(costs)
    try:
        yield costs
    finally:
        _current.reset(token)
        costs["peak_rss_mb"] = peak_rss_mb()


def clock() -> tuple[float, float, float]:
    """Wall, process CPU and system CPU seconds now (all threads).

    The system seconds are the part of :func:`time.process_time` that the kernel
    spent for the process (page faults, memory mapping, other system calls), not
    the process's own computation.
    """
    system = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    return time.perf_counter(), time.process_time(), system


def since(start: tuple[float, float, float]) -> tuple[float, float, float]:
    """The :func:`clock` readings elapsed since ``start``."""
    now = clock()
    return now[0] - start[0], now[1] - start[1], now[2] - start[2]


def peak_rss_mb() -> float:
    """The process's peak resident memory so far, in MiB (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the block's wall time as ``<name>_s`` and CPU time as ``<name>_cpu_s``."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        count(f"{name}_s", time.perf_counter() - wall)
        count(f"{name}_cpu_s", time.process_time() - cpu)


def count(name: str, amount: float = 1.0) -> None:
    """Add ``amount`` to the counter ``name`` of the current recording, if any."""
    costs = _current.get()
    if costs is not None:
        costs[name] += float(amount)
