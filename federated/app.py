"""The Flower app: ``ServerApp`` and ``ClientApp`` on Flower's Message API.

``flwr run .`` (components and defaults in ``pyproject.toml``) runs it in
simulation; :func:`run_simulation` runs it from Python; the same apps run on Flower's
deployment engine (a SuperLink and SuperNodes started with
``--node-config "partition-id=<i> num-partitions=<n>"``).

Protocol, per run:

1. The server solves every client's schedule (:mod:`federated.schedule`) before
   anything is sent; an unreachable budget or bad config fails here.
2. A *query* round asks every node for its ``partition-id`` and ``num-partitions``;
   the server checks they form exactly ``0..n-1`` (a misconfigured deployment fails
   here).
3. :class:`ScheduledFedAvg` sends each node its own per-round configuration (rate,
   sigma, steps) and aggregates by FedAvg. Any client error, missing reply, or a
   client reporting more epsilon than its budget raises (Flower itself would log and
   carry on with a frozen model).

Clients rebuild their partition from the shared config (same seed, same split as
the server), run one round of :func:`federated.client.local_train` with the
generator ``default_rng([seed, partition, round])``, keep their accountant history
in ``context.state`` and report the epsilon spent so far. :func:`run_in_process`
runs the same client and server steps without Flower, for side-by-side checks.
Optionally the strategy is wrapped in Flower's own
``DifferentialPrivacyServerSideFixedClipping`` (``dp-wrapper = true``; its noise
comes from numpy's global generator, so that variant is not bit-reproducible).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from federated.accounting import Phase, epsilon, merge
from federated.client import LocalData, Params, StepPlan, init_params, local_train
from federated.arms import central_noise_multiplier
from federated.schedule import (
    ClientSchedule,
    Policy,
    StrictOnly,
    TimeAdaptive,
    Uniform,
    plan_schedules,
)
from federated.tasks import FederatedTask, make_task
from federated.training import accuracy_of

logger = logging.getLogger(__name__)

POLICIES = ("time-adaptive", "strict-only", "uniform", "dp-fedavg", "none")


def _floats(value: Any, what: str) -> tuple[float, ...]:
    if isinstance(value, str):
        items = [v for v in value.replace(" ", "").split(",") if v]
        try:
            return tuple(float(v) for v in items)
        except ValueError:
            raise ValueError(
                f"{what} must be comma-separated numbers, got {value!r}"
            ) from None
    if isinstance(value, list | tuple):
        return tuple(float(v) for v in value)
    raise ValueError(f"{what} must be comma-separated numbers, got {value!r}")


Num = TypeVar("Num", int, float)


def _num(value: object, kind: type[Num]) -> Num:
    """A record scalar as int or float; anything else is a protocol error."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a number in the message, got {value!r}")
    return kind(value)


def _arrays(record: object) -> Params:
    """The numpy arrays of an ArrayRecord."""
    if not isinstance(record, ArrayRecord):
        raise ValueError(f"expected an ArrayRecord in the message, got {type(record)}")
    return [np.asarray(a, dtype=np.float64) for a in record.to_numpy_ndarrays()]


@dataclass(frozen=True)
class AppConfig:
    """Run configuration of the Flower app (keys hyphenated in ``pyproject.toml``).

    Parameters
    ----------
    policy : {"time-adaptive", "strict-only", "uniform", "dp-fedavg", "none"}
        Spending schedule ("uniform" is IDP-FedAvg, "dp-fedavg" holds everyone to
        the strictest budget, "none" trains without DP).
    dp_wrapper : bool
        Wrap the strategy in Flower's server-side fixed-clipping DP (needs
        ``policy = "none"``); sigma is solved for the strictest budget at client
        level.
    Other fields mirror :class:`federated.scenario.FederatedGame`.
    """

    dataset: str = "digits"
    n_clients: int = 2
    alpha: float = 0.5
    budgets: tuple[float, ...] = (1.0, 3.0, 8.0)
    group_fractions: tuple[float, ...] = (0.4, 0.3, 0.3)
    delta: float = 1e-5
    member_fraction: float = 0.8
    rounds: int = 10
    local_steps: int = 4
    lr: float = 0.5
    clip: float = 1.0
    model: str = "softmax"
    hidden: int = 32
    batch_rate: float = 0.1
    sigma: float = 1.0
    policy: str = "time-adaptive"
    save_fraction: float = 0.5
    save_ratio: float = 0.7
    dp_wrapper: bool = False
    clipping_norm: float = 1.0
    seed: int = 0
    min_nodes: int = 2
    timeout: float = 600.0
    result_path: str = ""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"AppConfig.policy must be one of {POLICIES}, got {self.policy!r}"
            )
        if self.dp_wrapper and self.policy != "none":
            raise ValueError(
                "AppConfig.dp_wrapper adds Flower's central DP; it needs "
                "policy='none', "
                f"got policy={self.policy!r}"
            )
        if self.n_clients < 1 or self.min_nodes < 1:
            raise ValueError(
                f"AppConfig.n_clients and min_nodes must be >= 1, got "
                f"{self.n_clients} and {self.min_nodes}"
            )
        if self.timeout <= 0:
            raise ValueError(f"AppConfig.timeout must be > 0, got {self.timeout}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> AppConfig:
        """Build from a run config or ConfigRecord (hyphens or underscores).

        ``num-server-rounds`` is accepted for ``rounds``. Unknown keys are errors.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = "rounds" if key == "num-server-rounds" else key.replace("-", "_")
            if name not in fields:
                if key in _TRANSPORT_KEYS:
                    continue
                raise ValueError(
                    f"unknown app config key {key!r}; known: "
                    f"{sorted(k.replace('_', '-') for k in fields)}"
                )
            default = fields[name].default
            if name in ("budgets", "group_fractions"):
                kwargs[name] = _floats(value, key)
            elif isinstance(default, bool):
                kwargs[name] = (
                    value if isinstance(value, bool) else str(value).lower() == "true"
                )
            elif isinstance(default, int):
                kwargs[name] = int(value)
            elif isinstance(default, float):
                kwargs[name] = float(value)
            else:
                kwargs[name] = str(value)
        return cls(**kwargs)

    def record(self) -> dict[str, Any]:
        """The config as ConfigRecord values (lists as comma-separated strings)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = ",".join(repr(v) for v in value)
            out[f.name.replace("_", "-")] = value
        return out


_TRANSPORT_KEYS = frozenset(
    {"server-round", "rate", "round-sigma", "steps", "partition-id"}
)


@functools.lru_cache(maxsize=8)
def build_task(config: AppConfig) -> FederatedTask:
    """The task every party rebuilds from the shared config (same seed, same split)."""
    return make_task(
        dataset=config.dataset,
        n_clients=config.n_clients,
        alpha=config.alpha,
        budgets=config.budgets,
        group_fractions=config.group_fractions,
        delta=config.delta,
        member_fraction=config.member_fraction,
        test_fraction=0.2,
        rng=np.random.default_rng(config.seed),
    )


def _policy(config: AppConfig) -> Policy:
    if config.policy == "time-adaptive":
        return TimeAdaptive(config.save_fraction, config.save_ratio)
    if config.policy == "strict-only":
        return StrictOnly(config.save_fraction, config.save_ratio)
    return Uniform()


def plan(config: AppConfig, task: FederatedTask) -> list[ClientSchedule] | None:
    """Every client's schedule (None without DP); raises before any training."""
    if config.policy == "none":
        return None
    budgets = list(task.budgets)
    if config.policy == "dp-fedavg":
        budgets = [min(budgets)] * len(budgets)
    return plan_schedules(
        budgets,
        _policy(config),
        delta=config.delta,
        rounds=config.rounds,
        steps=config.local_steps,
        sigma=config.sigma,
    )


def round_plan(
    config: AppConfig, schedules: list[ClientSchedule] | None, client: int, rnd: int
) -> StepPlan:
    """Plan of ``client`` in round ``rnd`` (1-based)."""
    if schedules is None:
        return StepPlan(config.batch_rate, config.local_steps, None)
    r = schedules[client].rounds[rnd - 1]
    return StepPlan(r.rate, r.steps, r.sigma)


def client_round(
    config: AppConfig, client: int, rnd: int, params: Params, step: StepPlan
) -> tuple[Params, LocalData]:
    """One client's round: the same code under Flower and in-process."""
    data = build_task(config).data.clients[client]
    rng = np.random.default_rng([config.seed, client, rnd])
    new = local_train(params, data, step, lr=config.lr, clip=config.clip, rng=rng)
    return new, data


def initial_params(config: AppConfig, task: FederatedTask) -> Params:
    """Initial global weights, from the run seed."""
    return init_params(
        "mlp" if config.model == "mlp" else "softmax",
        task.data.dim,
        task.data.n_classes,
        config.hidden,
        np.random.default_rng([config.seed, 10**6]),
    )


@dataclass
class AppRun:
    """What a run returns: accuracy per round, final weights, epsilon per client."""

    curve: list[float]
    params: Params
    epsilons: list[float]
    budgets: list[float]
    histories: list[list[Phase]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "curve": self.curve,
            "epsilons": self.epsilons,
            "budgets": self.budgets,
        }


def run_in_process(config: AppConfig) -> AppRun:
    """Run the app's client and server steps in one process, without Flower."""
    if config.dp_wrapper:
        raise ValueError(
            "run_in_process has no Flower DP wrapper; use "
            "federated.arms.FlowerCentralDP for its in-process equivalent"
        )
    task = build_task(config)
    schedules = plan(config, task)
    params = initial_params(config, task)
    histories: list[list[Phase]] = [[] for _ in task.data.clients]
    curve = []
    for rnd in range(1, config.rounds + 1):
        updates, sizes = [], []
        for n in range(len(task.data.clients)):
            step = round_plan(config, schedules, n, rnd)
            new, data = client_round(config, n, rnd, params, step)
            updates.append(new)
            sizes.append(len(data))
            if step.sigma is not None:
                histories[n] = merge(
                    [*histories[n], (step.sigma, step.rate, step.steps)]
                )
        w = np.asarray(sizes, dtype=np.float64) / sum(sizes)
        params = [
            sum(wi * u[i] for wi, u in zip(w, updates, strict=True))
            for i in range(len(params))
        ]
        curve.append(accuracy_of(params, task.data.test_X, task.data.test_y))
    eps = [epsilon(h, config.delta) for h in histories]
    return AppRun(curve, params, eps, list(task.budgets), histories)


class ClientFailure(RuntimeError):
    """A client failed, did not answer, or overspent: the run is stopped."""


class ScheduledFedAvg(FedAvg):
    """FedAvg that sends each node its own per-round plan and fails loudly.

    Parameters
    ----------
    config : AppConfig
        The run configuration (sent along so clients rebuild their data).
    partitions : dict of int to int
        Node id to partition id, from the query round.
    schedules : list of ClientSchedule or None
        Per-partition schedules (None without DP).
    """

    def __init__(
        self,
        config: AppConfig,
        partitions: dict[int, int],
        schedules: list[ClientSchedule] | None,
    ) -> None:
        n = len(partitions)
        super().__init__(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=n,
            min_available_nodes=n,
        )
        self.config = config
        self.partitions = partitions
        self.schedules = schedules
        self.spent: dict[int, float] = {}
        self.budgets = list(build_task(config).budgets)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per node, each with that node's plan for this round."""
        messages = []
        for node_id, pid in sorted(self.partitions.items()):
            step = round_plan(self.config, self.schedules, pid, server_round)
            cfg = ConfigRecord(
                {
                    **self.config.record(),
                    "server-round": server_round,
                    "rate": step.rate,
                    "round-sigma": -1.0 if step.sigma is None else step.sigma,
                    "steps": step.steps,
                }
            )
            messages.append(
                Message(
                    content=RecordDict({"arrays": arrays, "config": cfg}),
                    message_type=MessageType.TRAIN,
                    dst_node_id=node_id,
                )
            )
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Raise on any error, missing reply or overspent budget; then FedAvg."""
        got = list(replies)
        for msg in got:
            if msg.has_error():
                raise ClientFailure(
                    f"round {server_round}: node {msg.metadata.src_node_id} failed: "
                    f"{msg.error.reason}"
                )
        if len(got) != len(self.partitions):
            raise ClientFailure(
                f"round {server_round}: {len(got)} replies from "
                f"{len(self.partitions)} clients (timeout or lost node)"
            )
        for msg in got:
            metrics = msg.content["metrics"]
            pid = _num(metrics["partition-id"], int)
            eps = _num(metrics["eps-spent"], float)
            if eps > self.budgets[pid] * (1 + 1e-9) and self.schedules is not None:
                raise ClientFailure(
                    f"round {server_round}: client {pid} spent epsilon {eps:.4f} over "
                    f"its budget {self.budgets[pid]}"
                )
            self.spent[pid] = eps
        return super().aggregate_train(server_round, got)


def discover(grid: Grid, config: AppConfig) -> dict[int, int]:
    """Query every node for its partition; check they are exactly 0..n-1."""
    nodes: list[int] = []
    start = time.monotonic()
    while len(nodes := list(grid.get_node_ids())) < config.min_nodes:
        if time.monotonic() - start > config.timeout:
            raise ClientFailure(
                f"only {len(nodes)} of {config.min_nodes} nodes connected"
            )
        time.sleep(0.5)
    query = [
        Message(
            content=RecordDict({"config": ConfigRecord({"seed": config.seed})}),
            message_type=MessageType.QUERY,
            dst_node_id=node,
        )
        for node in nodes
    ]
    replies = list(grid.send_and_receive(query, timeout=config.timeout))
    partitions: dict[int, int] = {}
    for msg in replies:
        if msg.has_error():
            raise ClientFailure(
                f"node {msg.metadata.src_node_id} failed: {msg.error.reason}"
            )
        metrics = msg.content["metrics"]
        count = _num(metrics["num-partitions"], int)
        if count != len(nodes):
            raise ValueError(
                f"node {msg.metadata.src_node_id} says num-partitions={count}, but "
                f"{len(nodes)} nodes are connected: misconfigured deployment"
            )
        partitions[msg.metadata.src_node_id] = _num(metrics["partition-id"], int)
    if len(replies) != len(nodes) or sorted(partitions.values()) != list(
        range(len(nodes))
    ):
        raise ValueError(
            f"partition ids {sorted(partitions.values())} are not 0..{len(nodes) - 1}: "
            "misconfigured deployment"
        )
    return partitions


def serve(grid: Grid, config: AppConfig) -> AppRun:
    """The ServerApp's body: plan, discover, train, evaluate."""
    partitions = discover(grid, config)
    config = dataclasses.replace(config, n_clients=len(partitions))
    task = build_task(config)
    schedules = plan(config, task)
    strategy: FedAvg | DifferentialPrivacyServerSideFixedClipping
    inner = ScheduledFedAvg(config, partitions, schedules)
    strategy = inner
    if config.dp_wrapper:
        sigma = central_noise_multiplier(min(task.budgets), config.delta, config.rounds)
        strategy = DifferentialPrivacyServerSideFixedClipping(
            inner, sigma, config.clipping_norm, len(partitions)
        )

    def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        acc = accuracy_of(
            arrays.to_numpy_ndarrays(), task.data.test_X, task.data.test_y
        )
        return MetricRecord({"accuracy": acc})

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial_params(config, task)),
        num_rounds=config.rounds,
        timeout=config.timeout,
        evaluate_fn=evaluate,
    )
    if len(result.train_metrics_clientapp) != config.rounds:
        raise ClientFailure(
            f"only {len(result.train_metrics_clientapp)} of {config.rounds} rounds "
            "aggregated"
        )
    curve = [
        _num(result.evaluate_metrics_serverapp[r]["accuracy"], float)
        for r in range(1, config.rounds + 1)
    ]
    eps = [inner.spent.get(p, 0.0) for p in range(len(partitions))]
    run = AppRun(curve, result.arrays.to_numpy_ndarrays(), eps, list(task.budgets))
    if config.result_path:
        Path(config.result_path).write_text(json.dumps(run.to_dict()), encoding="utf-8")
    return run


def _partition(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config["partition-id"]), int(
            context.node_config["num-partitions"]
        )
    except KeyError:
        raise ValueError(
            "this SuperNode has no 'partition-id'/'num-partitions' in its node config; "
            'start it with --node-config "partition-id=<i> num-partitions=<n>"'
        ) from None


client_app = ClientApp()


@client_app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's partition."""
    pid, count = _partition(context)
    metrics = MetricRecord({"partition-id": pid, "num-partitions": count})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local (DP-)SGD at this node's scheduled rate."""
    cfg = msg.content["config"]
    pid, count = _partition(context)
    config = dataclasses.replace(AppConfig.from_mapping(dict(cfg)), n_clients=count)
    rnd = _num(cfg["server-round"], int)
    sigma = _num(cfg["round-sigma"], float)
    step = StepPlan(
        _num(cfg["rate"], float), _num(cfg["steps"], int), None if sigma <= 0 else sigma
    )
    params = _arrays(msg.content["arrays"])
    new, data = client_round(config, pid, rnd, params, step)
    state = context.state
    record = state.get("accountant")
    history: list[Phase] = []
    if isinstance(record, ConfigRecord):
        history = list(
            zip(
                _floats(record["sigma"], "sigma"),
                _floats(record["rate"], "rate"),
                [int(v) for v in _floats(record["steps"], "steps")],
                strict=True,
            )
        )
    if step.sigma is not None:
        history = merge([*history, (step.sigma, step.rate, step.steps)])
    state["accountant"] = ConfigRecord(
        {
            "sigma": [h[0] for h in history],
            "rate": [h[1] for h in history],
            "steps": [h[2] for h in history],
        }
    )
    metrics = MetricRecord(
        {
            "num-examples": len(data),
            "partition-id": pid,
            "eps-spent": epsilon(history, config.delta),
        }
    )
    content = RecordDict({"arrays": ArrayRecord(new), "metrics": metrics})
    return Message(content=content, reply_to=msg)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of ``flwr run``: the run config comes from ``pyproject.toml``.

    The summary (accuracy curve, epsilon per client) is written as JSON to
    ``result-path`` or, if unset, to ``$FEDERATED_RESULT_PATH`` when that is set.
    """
    config = AppConfig.from_mapping(dict(context.run_config))
    if not config.result_path:
        path = os.environ.get("FEDERATED_RESULT_PATH", "")
        config = dataclasses.replace(config, result_path=path)
    run = serve(grid, config)
    logger.info(
        "final accuracy %.4f; epsilon per client %s (budgets %s)",
        run.curve[-1],
        [round(e, 4) for e in run.epsilons],
        run.budgets,
    )


def run_simulation(config: AppConfig, verbose: bool = False) -> AppRun:
    """Run the app in Flower's simulation engine (Ray) with ``config.n_clients`` nodes.

    The schedules are solved first, so a bad config fails before Ray starts. Client
    errors raise :class:`ClientFailure`.
    """
    config = dataclasses.replace(config, min_nodes=config.n_clients)
    plan(config, build_task(config))
    from flwr.simulation import run_simulation as flwr_run_simulation

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    holder: list[AppRun] = []
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        holder.append(serve(grid, config))

    flwr_run_simulation(
        server_app=app,
        client_app=client_app,
        num_supernodes=config.n_clients,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "logging_level": "ERROR"},
        },
        verbose_logging=verbose,
    )
    if not holder:
        raise ClientFailure("the Flower simulation ended without a result")
    return holder[0]
