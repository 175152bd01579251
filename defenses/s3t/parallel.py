"""Run shard-training jobs serially, in local processes, or on a Ray cluster.

Shards are independent by construction (disjoint data, per-stage seeds), so they
train in parallel without changing a single bit of the result: every executor
returns the same stages. The executors themselves are the suite's shared ones
(:func:`defenses.parallel.map_jobs`); this module binds them to
:func:`~defenses.s3t.training.train_shard`.
"""

from __future__ import annotations

from collections.abc import Sequence

from defenses.parallel import EXECUTORS, Executor, map_jobs
from defenses.s3t.training import Order, ShardJob, StageState, train_shard

__all__ = ["EXECUTORS", "Executor", "run_jobs"]


def run_jobs(
    jobs: Sequence[ShardJob],
    executor: Executor = "serial",
    n_jobs: int = 1,
    ray_address: str | None = None,
) -> list[dict[Order, StageState]]:
    """Train every job with ``executor``; results in job order.

    ``run_jobs(jobs, ...)[i] == train_shard(jobs[i])`` for every executor (see
    :func:`defenses.parallel.map_jobs` for ``executor``, ``n_jobs`` and
    ``ray_address``).
    """
    return map_jobs(train_shard, jobs, executor, n_jobs, ray_address, desc="s3t shards")
