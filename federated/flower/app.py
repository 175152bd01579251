"""The package's own Flower app, built on the public pieces a user's app uses.

* ``client_app``: ``ClientApp(mods=[TimeAdaptiveMod(app_privacy)])``. Each client
  loads its own partition (``partition-id`` / ``num-partitions`` from its node
  config; the partition function :func:`client_data`), takes its round from
  :class:`~federated.flower.client.TimeAdaptiveClient` and runs
  :func:`federated.client.local_train` with the round's generator (operating-system
  entropy, fresh per client per round; a research seed only by the node's opt-in,
  in simulation, :func:`~federated.flower.runtime.round_rng`). In a deployment its
  privacy agreement comes from its node config alone (every key of
  :data:`~federated.flower.records.DEPLOYMENT_KEYS`); in Flower's simulation, where
  the node config sets no ``epsilon``, from the run config's privacy groups (the
  stand-in, :meth:`AppConfig.client_privacy`). Its evaluate function uses only the
  public held-out test set, and the mod runs it only for a node that opts in
  (``evaluate = "public"``).
* ``server_app``: FedAvg wrapped in
  :class:`~federated.flower.strategy.TimeAdaptiveStrategy` (or, for ``dp-wrapper``,
  Flower's ``DifferentialPrivacyServerSideFixedClipping``); it evaluates on the
  held-out test set only (:func:`federated.tasks.load_test_set`) and never draws
  client data. The summary (accuracy curve, per-client epsilon, budget and, for
  clients that evaluate, accuracy on the public split, ``status``) goes as JSON to
  ``result-path`` or ``$FEDERATED_RESULT_PATH``.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Strategy,
)

from defenses.arrays import FloatArray, IntArray

from ..arms import central_noise_multiplier
from ..client import (
    LocalData,
    Params,
    StepPlan,
    init_params,
    local_train,
)
from ..ledger import ClientPrivacy
from ..tasks import TEST_FRACTION, load_test_set
from ..training import accuracy_of
from . import records, runtime
from .client import TimeAdaptiveClient
from .config import AppConfig
from .console import flower_once, one_line_failures
from .mod import TimeAdaptiveMod, node_privacy
from .strategy import ClientFailure, TimeAdaptiveStrategy


@functools.lru_cache(maxsize=8)
def _partitions(config: AppConfig, n: int) -> tuple[LocalData, ...]:
    return config.task(n, np.random.default_rng(config.seed)).data.clients


def client_data(config: AppConfig, partition: int, partitions: int) -> LocalData:
    """Partition ``partition`` of ``partitions``: the partition function."""
    return _partitions(replace(config, n_clients=partitions), partitions)[partition]


def test_set(config: AppConfig) -> tuple[FloatArray, IntArray, int]:
    """The held-out test set the server evaluates on, and the number of classes."""
    return load_test_set(
        config.dataset, TEST_FRACTION, np.random.default_rng(config.seed)
    )


def initial_params(config: AppConfig, dim: int, n_classes: int) -> Params:
    """Initial global weights, from the run seed."""
    return init_params(
        "mlp" if config.model == "mlp" else "softmax",
        dim,
        n_classes,
        config.hidden,
        np.random.default_rng([config.seed, 10**6]),
    )


DATA_KEYS = {"dataset": str, "alpha": float, "member-fraction": float}
"""Keys that shape a node's records; on a SuperNode only its node config sets them."""


def data_config(config: AppConfig, context: Context) -> AppConfig:
    """The config the node's records (partition and public split) come from.

    In simulation, the run config (partitions are a function of it; the split may
    be evaluated on only where the node declares it disjoint). On a SuperNode the
    node owns its data: ``data-seed`` (required) and ``dataset``, ``alpha``,
    ``member-fraction`` from its node config, else the defaults, never from the
    run config the server sets.
    """
    if runtime.in_simulation():
        return config
    node = context.node_config
    if records.DATA_SEED not in node:
        raise runtime.NodeConfigError(
            f"this SuperNode's node config lacks {records.DATA_SEED!r}: its partition "
            "and public split are the node's own, never the run config's seed"
        )
    seed = int(records.typed(records.DATA_SEED, node[records.DATA_SEED], int))
    base = AppConfig()
    changes: dict[str, Any] = {
        key.replace("-", "_"): records.typed(
            key, node.get(key, getattr(base, key.replace("-", "_"))), kind
        )
        for key, kind in DATA_KEYS.items()
    }
    return replace(config, seed=seed, **changes)


def partition_of(context: Context) -> tuple[int, int]:
    """The node's ``(partition-id, num-partitions)`` from its node config."""
    try:
        pid = records.typed("partition-id", context.node_config["partition-id"], int)
        count = records.typed(
            "num-partitions", context.node_config["num-partitions"], int
        )
    except KeyError:
        raise runtime.NodeConfigError(
            "this SuperNode has no 'partition-id'/'num-partitions' in its node config; "
            'start it with --node-config "partition-id=<i> num-partitions=<n>"'
        ) from None
    if not 0 <= pid < count:
        raise runtime.NodeConfigError(f"partition-id {pid} is not in 0..{count - 1}")
    return int(pid), int(count)


def run_config(context: Context) -> AppConfig:
    """The run configuration from the client's own context."""
    return AppConfig.from_mapping(dict(context.run_config))


def app_privacy(config: AppConfig, context: Context) -> ClientPrivacy | None:
    """The client's agreement: its node config; in simulation, the run config's.

    A deployment takes every privacy key from the node config (the run config is
    the server's); a simulated node without ``epsilon`` takes its group's.
    """
    if not runtime.in_simulation():
        return node_privacy(context)
    if "epsilon" in context.node_config:
        defaults = {
            "delta": config.delta,
            "rounds": config.rounds,
            "local-steps": config.local_steps,
            "sigma": config.sigma,
            "save-fraction": config.save_fraction,
            "save-ratio": config.save_ratio,
        }
        return records.privacy_from_config(dict(context.node_config), defaults)
    return config.client_privacy(*partition_of(context))


def _arrays(msg: Message) -> Params:
    arrays = msg.content.array_records
    if len(arrays) != 1:
        raise ValueError(f"expected one ArrayRecord, got {len(arrays)}")
    record = next(iter(arrays.values()))
    return [np.asarray(a, dtype=np.float64) for a in record.to_numpy_ndarrays()]


def make_client_app(
    config: AppConfig | None = None, research_seed: int | None = None
) -> ClientApp:
    """The ClientApp; ``config`` fixes the run config (else each context's own).

    ``research_seed`` makes the noise reproducible (simulation only; a deployment
    refuses it): :func:`~federated.flower.runtime.round_rng`.
    """

    def own_config(context: Context) -> AppConfig:
        return run_config(context) if config is None else config

    def privacy(context: Context) -> ClientPrivacy | None:
        return app_privacy(own_config(context), context)

    def public_examples(context: Context) -> int | None:
        # In simulation a partition is a function of the run config (the server
        # can compute its size anyway): its size is the agreed public count, as
        # the run config's groups stand in for budgets. A SuperNode declares its
        # own (public-num-examples), else 1.
        if not runtime.in_simulation():
            return None
        return len(client_data(own_config(context), *partition_of(context)))

    def training_records(context: Context) -> FloatArray:
        cfg = data_config(own_config(context), context)
        return client_data(cfg, *partition_of(context)).X

    def public_records(context: Context) -> FloatArray:
        return test_set(data_config(own_config(context), context))[0]

    mod = TimeAdaptiveMod(
        privacy,
        public_examples=public_examples,
        training_records=training_records,
        public_records=public_records,
    )
    app = mod.register(ClientApp(mods=[mod]))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        """One round of local (DP-)SGD at the round the client granted."""
        flower_once()
        cfg = own_config(context)
        pid, count = partition_of(context)
        agreement = privacy(context)
        if agreement is None:
            asked = msg.content["config"]["server-round"]
            server_round = int(records.typed("server-round", asked, int))
            step = StepPlan(cfg.batch_rate, cfg.local_steps, None)
            rng = runtime.round_rng(context, server_round, research_seed)
        else:
            client = TimeAdaptiveClient(agreement, context, research_seed)
            granted = client.round(msg)
            step = StepPlan(granted.rate, granted.steps, granted.sigma)
            rng = granted.rng
        data = client_data(data_config(cfg, context), pid, count)
        new = local_train(
            _arrays(msg),
            data,
            step,
            lr=cfg.lr,
            clip=cfg.clip,
            rng=rng,
            public_count=mod.public_examples(context),
        )
        metrics = MetricRecord({"num-examples": 1})  # the mod sets the public count
        content = RecordDict({"arrays": ArrayRecord(new), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        """Accuracy of the global model on the node's public held-out split only."""
        X_test, y_test, _ = test_set(data_config(own_config(context), context))
        acc = accuracy_of(_arrays(msg), X_test, y_test)
        metrics = MetricRecord({"num-examples": len(y_test), "accuracy": acc})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


client_app = make_client_app()


@dataclass
class AppRun:
    """What a run returns: accuracy per round, final weights, per-client privacy."""

    curve: list[float]
    params: Params
    epsilons: list[float]
    budgets: list[float]
    clients: list[dict[str, Any]] = field(default_factory=list)
    status: str = "completed"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "status": self.status,
            "curve": self.curve,
            "epsilons": self.epsilons,
            "budgets": self.budgets,
            "clients": self.clients,
        }


def serve(grid: Grid, config: AppConfig) -> AppRun:
    """The ServerApp's body: wrap FedAvg, train, evaluate on the test set."""
    flower_once()  # Flower's lines once, though Opacus installs a root handler
    one_line_failures()  # a client that stops the run: one line, no traceback
    X_test, y_test, n_classes = test_set(config)
    n = config.min_nodes
    fedavg = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=1.0 if config.policy != "none" else 0.0,
        min_train_nodes=n,
        min_evaluate_nodes=n,
        min_available_nodes=n,
    )
    strategy: Strategy = fedavg
    wrapper: TimeAdaptiveStrategy | None = None
    if config.dp_wrapper:
        sigma = central_noise_multiplier(
            min(config.budgets), config.delta, config.rounds
        )
        strategy = DifferentialPrivacyServerSideFixedClipping(
            fedavg, sigma, config.clipping_norm, n
        )
    elif config.policy != "none":
        wrapper = TimeAdaptiveStrategy(fedavg, timeout=config.timeout)
        strategy = wrapper

    def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord(
            {"accuracy": accuracy_of(arrays.to_numpy_ndarrays(), X_test, y_test)}
        )

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial_params(config, X_test.shape[1], n_classes)),
        num_rounds=config.rounds,
        timeout=config.timeout,
        evaluate_fn=evaluate_fn,
    )
    if len(result.train_metrics_clientapp) != config.rounds:
        raise ClientFailure(
            f"only {len(result.train_metrics_clientapp)} of {config.rounds} rounds "
            "aggregated"
        )
    curve = [
        float(
            records.typed(
                "accuracy", result.evaluate_metrics_serverapp[r]["accuracy"], float
            )
        )
        for r in range(1, config.rounds + 1)
    ]
    clients = [] if wrapper is None else wrapper.final_summary()
    clients.sort(key=lambda row: int(row["client"]) if row["client"].isdigit() else 0)
    run = AppRun(
        curve,
        result.arrays.to_numpy_ndarrays(),
        [float(row["epsilon"]) for row in clients],
        [float(row["budget"]) for row in clients],
        clients,
    )
    if config.result_path:
        Path(config.result_path).write_text(json.dumps(run.to_dict()), encoding="utf-8")
    return run


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of ``flwr run``: the run config comes from ``pyproject.toml``."""
    config = run_config(context)
    if not config.result_path:
        config = replace(
            config, result_path=os.environ.get("FEDERATED_RESULT_PATH", "")
        )
    serve(grid, config)
