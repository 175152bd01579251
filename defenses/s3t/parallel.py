"""Run shard-training jobs serially, in local processes, or on a Ray cluster.

Shards are independent by construction (disjoint data, per-stage seeds), so they
train in parallel without changing a single bit of the result: every executor
returns the same stages. Ray (``executor="ray"``) connects to ``ray_address`` or, if
None, starts a local Ray instance on first use (left running for later calls; stop it
with ``ray.shutdown()``).
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Literal

from tqdm.auto import tqdm

from defenses.s3t.training import Order, ShardJob, StageState, train_shard

Executor = Literal["serial", "process", "ray"]
EXECUTORS: tuple[Executor, ...] = ("serial", "process", "ray")

logger = logging.getLogger(__name__)


def _ray_map(jobs: Sequence[ShardJob], n_jobs: int, address: str | None) -> list[Any]:
    import ray

    if not ray.is_initialized():
        logger.info("starting Ray (%s)", address or "local")
        ray.init(
            address=address,
            num_cpus=None if address else n_jobs,
            include_dashboard=False,
            log_to_driver=False,
        )
    remote = ray.remote(num_cpus=1)(train_shard)
    return list(ray.get([remote.remote(job) for job in jobs]))


def run_jobs(
    jobs: Sequence[ShardJob],
    executor: Executor = "serial",
    n_jobs: int = 1,
    ray_address: str | None = None,
) -> list[dict[Order, StageState]]:
    """Train every job; results in job order."""
    if not jobs:
        return []
    if executor == "serial" or (executor == "process" and n_jobs == 1):
        bar = tqdm(jobs, desc="s3t shards", disable=None, leave=False)
        return [train_shard(job) for job in bar]
    if executor == "process":
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=n_jobs, mp_context=context) as pool:
            return list(pool.map(train_shard, jobs))
    if executor == "ray":
        return _ray_map(jobs, n_jobs, ray_address)
    raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
