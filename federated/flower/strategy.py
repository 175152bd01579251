"""A strategy wrapper that makes any Flower strategy time-adaptive.

``TimeAdaptiveStrategy(FedAvg(...))`` (or FedProx, FedAdam, ...) lets the inner
strategy sample nodes and build its train messages, then adds to each node's config
that node's round of its own schedule (``dp-round``, ``dp-rate``, ``dp-sigma``,
``dp-steps``). The schedule is a *proposal*: the wrapper asks each new node for its
privacy agreement once (a ``dp-agreement`` query that
:class:`~federated.flower.mod.TimeAdaptiveMod` answers) and solves it with the same
solver the client verifies with, so honest proposals are granted as sent. Each round
it logs every client's epsilon (its own ledger's) against its budget through
Flower's logger, strips the privacy metrics before the inner strategy aggregates
(no average of epsilons over different budgets), and at the end logs a per-client
summary. It sends evaluate messages only to clients whose agreement opts in to a
public-split evaluate. A refused round, a client error or a missing reply raises
:class:`ClientFailure` (Flower alone would log and carry on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..ledger import ClientPrivacy
from ..schedule import ClientSchedule
from . import records
from .console import RunStopped, flower_once, one_line_failures


class ClientFailure(RunStopped):
    """A client refused, failed or did not answer: the run is stopped."""


class BudgetSpent(ClientFailure):
    """A client refused a round for its budget: one line names it and spent/budget."""


@dataclass
class ClientRecord:
    """What the server knows of one client: agreement, schedule, last reports."""

    node_id: int
    label: str
    privacy: ClientPrivacy | None
    schedule: ClientSchedule | None
    epsilon: float = 0.0
    accuracy: float | None = None
    evaluate: str = "refuse"


def _number(record: MetricRecord, key: str) -> float:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClientFailure(f"metric {key!r} is not a number: {value!r}")
    return float(value)


class TimeAdaptiveStrategy(Strategy):
    """Wrap ``strategy`` so every client trains on its own time-adaptive schedule.

    Parameters
    ----------
    strategy : flwr.serverapp.strategy.Strategy
        Any Flower strategy (it samples, builds messages and aggregates).
    timeout : float
        Seconds to wait for the agreement queries.
    accuracy_key : str
        Metric of evaluate replies reported per client in the summary.
    on_round : callable, optional
        ``on_round(server_round, clients)`` after each train round (for tests and
        result files).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        timeout: float = 600.0,
        accuracy_key: str = "accuracy",
        on_round: Callable[[int, dict[int, ClientRecord]], None] | None = None,
    ) -> None:
        super().__init__()
        self.strategy = strategy
        self.timeout = timeout
        self.accuracy_key = accuracy_key
        self.on_round = on_round
        self.clients: dict[int, ClientRecord] = {}

    def summary(self) -> None:
        """Log the wrapper and the inner strategy."""
        log(INFO, "\t├── TimeAdaptiveStrategy: per-client schedules from agreements")
        self.strategy.summary()

    def _discover(self, grid: Grid, nodes: list[int]) -> None:
        query = [
            Message(
                content=RecordDict({records.AGREEMENT: ConfigRecord()}),
                message_type=f"{MessageType.QUERY}.{records.AGREEMENT_ACTION}",
                dst_node_id=node,
            )
            for node in nodes
        ]
        replies = list(grid.send_and_receive(query, timeout=self.timeout))
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                raise ClientFailure(
                    f"node {node} did not give its privacy agreement "
                    f"({msg.error.reason}); its ClientApp needs "
                    "TimeAdaptiveMod(...).register(app)"
                )
            record = msg.content.get(records.AGREEMENT)
            privacy = (
                None if record is None else records.privacy_from_config(dict(record))
            )
            label = str(record.get("label") or node) if record else str(node)
            self.clients[node] = ClientRecord(
                node, label, privacy, None if privacy is None else privacy.schedule()
            )
            if record is not None:
                self.clients[node].evaluate = str(
                    record.get(records.EVALUATE, "refuse")
                )
        missing = sorted(set(nodes) - set(self.clients))
        if missing:
            raise ClientFailure(f"nodes {missing} did not report their agreement")

    def label(self, node: int, label: str) -> None:
        """Name a node in the logs (e.g. by its partition id)."""
        if node in self.clients:
            self.clients[node].label = label

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The inner strategy's messages, each with its node's proposed round."""
        messages = list(
            self.strategy.configure_train(server_round, arrays, config, grid)
        )
        new = [
            m.metadata.dst_node_id
            for m in messages
            if m.metadata.dst_node_id not in self.clients
        ]
        if new:
            self._discover(grid, new)
        out = []
        for msg in messages:
            client = self.clients[msg.metadata.dst_node_id]
            content = RecordDict()
            for name, item in msg.content.items():
                content[name] = (
                    ConfigRecord(dict(item)) if isinstance(item, ConfigRecord) else item
                )
            if client.schedule is not None:
                if server_round > len(client.schedule.rounds):
                    log(
                        WARNING,
                        "client %s agreed to %d rounds; not asked in round %d",
                        client.label,
                        len(client.schedule.rounds),
                        server_round,
                    )
                    continue
                step = client.schedule.rounds[server_round - 1]
                configs = list(content.config_records.values())
                if not configs:
                    content["config"] = ConfigRecord()
                    configs = list(content.config_records.values())
                configs[0][records.ROUND] = server_round
                configs[0][records.RATE] = step.rate
                configs[0][records.SIGMA] = step.sigma
                configs[0][records.STEPS] = step.steps
            out.append(
                Message(
                    content=content,
                    message_type=msg.metadata.message_type,
                    dst_node_id=msg.metadata.dst_node_id,
                    group_id=msg.metadata.group_id,
                )
            )
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Fail on any refusal or error; log each client's epsilon; aggregate."""
        got = list(replies)
        for msg in got:
            if msg.has_error():
                node = msg.metadata.src_node_id
                label = self.clients[node].label if node in self.clients else node
                reason = str(msg.error.reason)
                kind = (
                    BudgetSpent
                    if reason.startswith("refused: over-budget")
                    else ClientFailure
                )
                raise kind(
                    f"round {server_round}: client {label} (node {node}): {reason}"
                )
        for msg in got:
            client = self.clients[msg.metadata.src_node_id]
            for name, record in list(msg.content.metric_records.items()):
                if records.EPSILON not in record:
                    continue
                client.epsilon = _number(record, records.EPSILON)
                budget = _number(record, records.BUDGET)
                log(
                    INFO,
                    "round %d: client %s spent epsilon %.4f of its budget %.4g",
                    server_round,
                    client.label,
                    client.epsilon,
                    budget,
                )
                msg.content[name] = MetricRecord(
                    {
                        k: v
                        for k, v in record.items()
                        if k not in (records.EPSILON, records.BUDGET)
                    }
                )
        if self.on_round is not None:
            self.on_round(server_round, self.clients)
        return self.strategy.aggregate_train(server_round, got)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The inner strategy's evaluate messages to clients that evaluate.

        A client evaluates only if its agreement says so (``evaluate = "public"``:
        on a split it designates as public); the others would refuse.
        """
        return [
            msg
            for msg in self.strategy.configure_evaluate(
                server_round, arrays, config, grid
            )
            if msg.metadata.dst_node_id not in self.clients
            or self.clients[msg.metadata.dst_node_id].evaluate == "public"
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Keep each client's accuracy on its own data; aggregate."""
        got = list(replies)
        for msg in got:
            client = self.clients.get(msg.metadata.src_node_id)
            if client is None or msg.has_error():
                continue
            for record in msg.content.metric_records.values():
                if self.accuracy_key in record:
                    client.accuracy = _number(record, self.accuracy_key)
        return self.strategy.aggregate_evaluate(server_round, got)

    def final_summary(self) -> list[dict[str, Any]]:
        """Per client: label, final epsilon, budget, accuracy on its own data."""
        return [
            {
                "client": c.label,
                "epsilon": c.epsilon,
                "budget": None if c.privacy is None else c.privacy.epsilon,
                "accuracy": c.accuracy,
            }
            for c in sorted(self.clients.values(), key=lambda c: c.label)
        ]

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run the inner loop, then log the per-client privacy summary.

        A client's refusal or failure stops the run with one line (no traceback:
        :func:`~federated.flower.console.one_line_failures`).
        """
        flower_once()
        one_line_failures()
        result = super().start(
            grid,
            initial_arrays,
            num_rounds,
            timeout,
            train_config,
            evaluate_config,
            evaluate_fn,
        )
        log(INFO, "Per-client privacy (own ledger) and accuracy on own data:")
        for row in self.final_summary():
            accuracy = "n/a" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
            log(
                INFO,
                "\tclient %s: epsilon %.4f of budget %s, accuracy %s",
                row["client"],
                row["epsilon"],
                row["budget"],
                accuracy,
            )
        return result
