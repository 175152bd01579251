"""Run independent jobs serially, in local processes, or on a Ray cluster.

The one home of the suite's three executors, for any picklable function: S3T trains
its shards with them (:func:`defenses.s3t.parallel.run_jobs`) and the audit its
shadow models (:func:`defenses.audit.shadows.train_shadows`). Every executor returns
the results in job order, and the jobs carry their own seeds, so the executor never
changes a result. ``"process"`` uses ``spawn``-started worker processes; ``"ray"``
connects to ``ray_address`` or, if None, starts a local Ray instance on first use
(left running for later calls; stop it with ``ray.shutdown()``). A tqdm bar counts
finished jobs (hidden when the output is not a terminal).
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Literal, TypeVar

from tqdm.auto import tqdm

from defenses.checks import check_choice, check_int

Executor = Literal["serial", "process", "ray"]
EXECUTORS: tuple[Executor, ...] = ("serial", "process", "ray")

J = TypeVar("J")
R = TypeVar("R")

logger = logging.getLogger(__name__)

__all__ = ["EXECUTORS", "Executor", "map_jobs"]


def _process_map(
    fn: Callable[[J], R], jobs: Sequence[J], n_jobs: int, bar: Any
) -> list[R]:
    context = multiprocessing.get_context("spawn")
    results: dict[int, R] = {}
    with ProcessPoolExecutor(max_workers=n_jobs, mp_context=context) as pool:
        futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            bar.update(1)
    return [results[i] for i in range(len(jobs))]


def _ray_map(
    fn: Callable[[J], R],
    jobs: Sequence[J],
    n_jobs: int,
    address: str | None,
    bar: Any,
) -> list[R]:
    import ray

    if not ray.is_initialized():
        logger.info("starting Ray (%s)", address or "local")
        ray.init(
            address=address,
            num_cpus=None if address else n_jobs,
            include_dashboard=False,
            log_to_driver=False,
        )
    remote = ray.remote(num_cpus=1)(fn)
    refs = [remote.remote(job) for job in jobs]
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        bar.update(len(done))
    return list(ray.get(refs))


def map_jobs(
    fn: Callable[[J], R],
    jobs: Sequence[J],
    executor: Executor = "serial",
    n_jobs: int = 1,
    ray_address: str | None = None,
    desc: str = "jobs",
) -> list[R]:
    """Return ``[fn(job) for job in jobs]``, computed by ``executor``.

    Parameters
    ----------
    fn : callable
        A module-level (picklable) function for ``"process"`` and ``"ray"``.
    jobs : sequence
        Its arguments, one per job (picklable for ``"process"`` and ``"ray"``).
    executor : {"serial", "process", "ray"}
        Where the jobs run; ``"process"`` with ``n_jobs=1`` runs serially.
    n_jobs : int
        Worker processes (``"process"``) or CPUs of a local Ray instance.
    ray_address : str or None
        Address of a running Ray cluster; None starts a local one on first use.
    desc : str
        Label of the progress bar.
    """
    check_choice("executor", executor, EXECUTORS)
    check_int("n_jobs", n_jobs, minimum=1)
    if not jobs:
        return []
    with tqdm(total=len(jobs), desc=desc, disable=None, leave=False) as bar:
        if executor == "serial" or (executor == "process" and n_jobs == 1):
            results = []
            for job in jobs:
                results.append(fn(job))
                bar.update(1)
            return results
        if executor == "process":
            return _process_map(fn, jobs, n_jobs, bar)
        return _ray_map(fn, jobs, n_jobs, ray_address, bar)
