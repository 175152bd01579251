"""Running the package's app: in one process without Flower, or on Flower's simulation.

:func:`run_in_process` runs the same client step
(:func:`federated.flower.app.client_data`, the research generator
``default_rng([seed, partition, round])``, each client's own schedule from
:meth:`AppConfig.client_privacy`) and FedAvg weighted by partition size (the
simulated clients' public ``num-examples``) in a plain loop, for side-by-side
checks: it is a research tool, its noise is reproducible by design and it involves
no server.
:func:`run_simulation` runs ``server_app`` and ``client_app`` on Flower's simulation
engine (Ray), with OS-entropy noise unless the caller passes a ``research_seed``
(the simulated nodes' own opt-in), and each node's lifetime ledger in ``state_dir``.
Both solve every client's schedule before anything starts, so a budget no schedule
can meet fails first.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from ..accounting import Phase, epsilon, merge
from ..client import StepPlan, local_train
from ..schedule import ClientSchedule
from ..training import accuracy_of
from .app import (
    AppRun,
    client_data,
    initial_params,
    make_client_app,
    serve,
    test_set,
)
from .config import AppConfig
from .runtime import STATE_ENV
from .strategy import ClientFailure


def plan(config: AppConfig) -> list[ClientSchedule | None]:
    """Every client's own schedule (None for a non-private client); raises first."""
    privacy = [
        config.client_privacy(n, config.n_clients) for n in range(config.n_clients)
    ]
    return [None if p is None else p.schedule() for p in privacy]


def run_in_process(config: AppConfig) -> AppRun:
    """Run the app's client and server steps in one process, without Flower."""
    if config.dp_wrapper:
        raise ValueError(
            "run_in_process has no Flower DP wrapper; use "
            "federated.arms.FlowerCentralDP for its in-process equivalent"
        )
    n = config.n_clients
    schedules = plan(config)
    X_test, y_test, n_classes = test_set(config)
    params = initial_params(config, X_test.shape[1], n_classes)
    histories: list[list[Phase]] = [[] for _ in range(n)]
    curve = []
    for rnd in range(1, config.rounds + 1):
        updates, sizes = [], []
        for pid in range(n):
            schedule = schedules[pid]
            if schedule is None:
                step = StepPlan(config.batch_rate, config.local_steps, None)
            else:
                r = schedule.rounds[rnd - 1]
                step = StepPlan(r.rate, r.steps, r.sigma)
                histories[pid] = merge([*histories[pid], (r.sigma, r.rate, r.steps)])
            data = client_data(config, pid, n)
            rng = np.random.default_rng([config.seed, pid, rnd])
            updates.append(
                local_train(params, data, step, lr=config.lr, clip=config.clip, rng=rng)
            )
            sizes.append(len(data))  # the simulated clients' public counts
        w = np.asarray(sizes, dtype=np.float64) / sum(sizes)
        params = [
            sum(wi * u[i] for wi, u in zip(w, updates, strict=True))
            for i in range(len(params))
        ]
        curve.append(accuracy_of(params, X_test, y_test))
    budgets = [0.0 if s is None else s.budget for s in schedules]
    eps = [epsilon(h, config.delta) for h in histories]
    return AppRun(curve, params, eps, budgets)


def run_simulation(
    config: AppConfig,
    verbose: bool = False,
    *,
    research_seed: int | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> AppRun:
    """Run the app on Flower's simulation engine (Ray) with ``n_clients`` nodes.

    ``research_seed`` (the simulated nodes' opt-in) makes the noise reproducible
    (then the run equals :func:`run_in_process` with ``seed = research_seed``);
    ``state_dir`` holds the nodes' lifetime ledgers (default: the environment's,
    :func:`federated.flower.runtime.state_dir`), so a second run on the same
    folder spends from what the first left. Client refusals and errors raise
    :class:`ClientFailure`.
    """
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation as flwr_run_simulation

    config = replace(config, min_nodes=config.n_clients)
    plan(config)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    holder: list[AppRun] = []
    failures: list[BaseException] = []
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            holder.append(serve(grid, config))
        except BaseException as error:
            failures.append(error)
            raise

    saved = os.environ.get(STATE_ENV)
    if state_dir is not None:
        os.environ[STATE_ENV] = str(state_dir)  # Ray's workers inherit it
    try:
        flwr_run_simulation(
            server_app=app,
            client_app=make_client_app(config, research_seed),
            num_supernodes=config.n_clients,
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"num_cpus": 2, "logging_level": "ERROR"},
            },
            verbose_logging=verbose,
        )
    finally:
        if saved is None:
            os.environ.pop(STATE_ENV, None)
        else:
            os.environ[STATE_ENV] = saved
    if failures:
        raise ClientFailure(str(failures[0])) from failures[0]
    if not holder:
        raise ClientFailure("the Flower simulation ended without a result")
    return holder[0]
