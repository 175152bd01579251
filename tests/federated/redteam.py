"""A competent malicious server against the federated clients: attacks and judge.

Each attack is played by a real Flower ``ServerApp`` (over the in-process loopback
transport, or Flower's own simulation with two Ray actors) against the package's
app or the example. The judge recomputes every client's true epsilon with Opacus's
own RDP accountant (its default 150 orders, not the client's report) from what the
client actually released: every train reply that came back with arrays, at the
values the server asked for; unbounded when the server could subtract the noise or
when a reply was computed from private records outside the accounting.
``python -m tests.federated.redteam`` prints the table of ``docs/federated.md``
(with the release path's attacks of :mod:`tests.federated.redteam_release`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from defense_suite.federated.flower import (
    ClientFailure,
    ClientPrivacy,
    TimeAdaptiveStrategy,
    records,
)
from defense_suite.federated.flower.app import (
    client_app,
    client_data,
    initial_params,
    make_client_app,
    server_app,
    test_set,
)
from defense_suite.federated.flower.config import AppConfig
from defense_suite.federated.softmax import softmax_step
from tests.federated.loopback import LoopbackGrid, node_contexts

DELTA = 1e-5
PUBLIC = 500
"""The SuperNodes' public record count (``public-num-examples``): the normalizer."""
BUDGETS = (1.0, 3.0)
CONFIG = AppConfig(
    n_clients=2,
    rounds=2,
    local_steps=1,
    policy="uniform",
    sigma=1.0,
    min_nodes=2,
    budgets=BUDGETS,
    group_fractions=(0.5, 0.5),
    timeout=120.0,
)


@dataclass
class Outcome:
    """What an attack got: the clients' answers and their true epsilons."""

    attack: str
    answers: list[str]
    epsilons: list[float]

    def row(self) -> str:
        """A Markdown table row (epsilons "n/a" for a measurement, not a run)."""
        eps = " | ".join(f"{e:.4f}" for e in self.epsilons) or "n/a | n/a"
        return f"| {self.attack} | {'; '.join(sorted(set(self.answers)))} | {eps} |"


def agreement(budget: float, config: AppConfig = CONFIG, **extra: object) -> dict:
    """A SuperNode's full node config: its whole privacy agreement and ledger."""
    return {
        "epsilon": budget,
        "delta": DELTA,
        "rounds": config.rounds,
        "local-steps": config.local_steps,
        "sigma": config.sigma,
        "spending": "uniform",
        "accountant": "rdp",
        "ledger-init": True,
        "data-seed": 0,
        "public-num-examples": PUBLIC,
        **extra,
    }


def nodes(config: AppConfig = CONFIG, run_id: int = 1, **extra: object) -> dict:
    """The deployment's node contexts (full agreements, fresh state), for one run."""
    contexts = node_contexts(
        config.n_clients,
        config.record(),
        **{str(i): agreement(b, config, **extra) for i, b in enumerate(BUDGETS)},
    )
    for context in contexts.values():
        context.run_id = run_id
    return contexts


def server_context(config: AppConfig = CONFIG, run_id: int = 1) -> Context:
    """The ServerApp's context: the run config is the server's."""
    return Context(
        run_id=run_id,
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config=config.record(),
    )


def answers(grids: list[LoopbackGrid], kind: str = "train") -> list[str]:
    """Each reply to a ``kind`` message: ``released`` or its error reason."""
    out = []
    for grid in grids:
        for sent, reply in zip(grid.sent, grid.replies, strict=True):
            if sent.metadata.message_type == kind:
                out.append(reply.error.reason if reply.has_error() else "released")
    return out


def true_epsilon(
    pairs: list[tuple[Message, Message]],
    node: int,
    *,
    private_evaluate: bool = False,
    denoised: bool = False,
) -> float:
    """Opacus RDP epsilon at delta 1e-5 of everything ``node`` released.

    ``pairs`` are (request, reply). A train reply with arrays counts at the
    (sigma, rate, steps) the server asked for (the client trains at exactly the
    granted values); an evaluate reply with content counts as unbounded when the
    app computed it from private records; ``denoised`` (the server can subtract
    the noise) makes any train release unbounded.
    """
    from opacus.accountants import RDPAccountant

    history: list[tuple[float, float, int]] = []
    for sent, reply in pairs:
        if sent.metadata.dst_node_id != node or reply.has_error():
            continue
        kind = sent.metadata.message_type
        if kind == "train" and reply.content.array_records:
            if denoised:
                return math.inf
            cfg = sent.content["config"]
            history.append(
                (float(cfg[records.SIGMA]), float(cfg[records.RATE]),
                 int(cfg[records.STEPS]))
            )  # fmt: skip
        elif kind == "evaluate" and private_evaluate and reply.has_content():
            return math.inf
    if not history:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = history
    return float(accountant.get_epsilon(DELTA))


def pairs_of(grids: list[LoopbackGrid]) -> list[tuple[Message, Message]]:
    """Every (request, reply) pair the grids carried."""
    return [p for g in grids for p in zip(g.sent, g.replies, strict=True)]


def epsilons(grids: list[LoopbackGrid], **judge: bool) -> list[float]:
    """Every client's true epsilon over ``grids`` (nodes 100, 101)."""
    return [true_epsilon(pairs_of(grids), 100 + i, **judge) for i in range(2)]


def honest_run(
    config: AppConfig = CONFIG,
    run_id: int = 1,
    contexts: dict | None = None,
    app: object = None,
) -> tuple[LoopbackGrid, BaseException | None]:
    """The package's real ServerApp and ClientApp, over the loopback transport."""
    grid = LoopbackGrid(app or client_app, contexts or nodes(config, run_id))
    try:
        server_app(grid, server_context(config, run_id))
    except Exception as error:  # a refusal stops the run: ClientFailure
        return grid, error
    return grid, None


def replay_residual(grid: LoopbackGrid, config: AppConfig = CONFIG) -> float:
    """The server's noise replay, as the issue played it: residual / noise scale.

    The server knows the run seed, the partition id (the agreement's label) and
    the round, and here even the client's records. It replays the generator
    ``default_rng([seed, partition, round])`` that drew the round's Poisson batch
    and noise before this fix, recovers the clipped gradient sum from the release
    and compares it with the clipped sum on the replayed batch. Returns the
    smallest ``||recovered - clipped sum|| / (sigma C sqrt(D))`` over round-1
    releases: about 0 when the replay works, about 1.4 when the noise is the
    client's own (two independent draws).
    """
    X_test, _, n_classes = test_set(config)
    W0, b0 = initial_params(config, X_test.shape[1], n_classes)
    worst = math.inf
    for sent, reply in zip(grid.sent, grid.replies, strict=True):
        if sent.metadata.message_type != "train" or reply.has_error():
            continue
        cfg = sent.content["config"]
        if cfg[records.ROUND] != 1:
            continue
        pid = sent.metadata.dst_node_id - 100
        data = client_data(config, pid, config.n_clients)
        n, q = len(data), float(cfg[records.RATE])
        rng = np.random.default_rng([config.seed, pid, 1])
        batch = np.flatnonzero(rng.random(n) < q)
        gW, gb = softmax_step(W0, b0, data.X[batch], data.y[batch], config.clip)
        clipped = np.concatenate([gW.ravel(), gb])
        noise = rng.normal(0.0, config.sigma * config.clip, size=clipped.shape)
        W1, b1 = reply.content["arrays"].to_numpy_ndarrays()
        step = np.concatenate([(W0 - W1).ravel(), b0 - b1]) / config.lr
        recovered = step * q * PUBLIC - noise
        scale = config.sigma * config.clip * math.sqrt(clipped.size)
        worst = min(worst, float(np.linalg.norm(recovered - clipped)) / scale)
    return worst


def noise_replay(research_seed: bool = False) -> tuple[Outcome, float]:
    """The honest run, then the replay; ``research_seed``: the node opted in."""
    extra = {"research-seed": CONFIG.seed} if research_seed else {}
    grid, _ = honest_run(contexts=nodes(**extra))
    residual = replay_residual(grid)
    name = "noise replay" + (" (research seed, simulation)" if research_seed else "")
    eps = epsilons([grid], denoised=residual < 1e-3)
    return Outcome(name, [f"residual {residual:.3f} x noise scale"], eps), residual


def second_run_and_restart() -> tuple[Outcome, Outcome]:
    """Run 1 (honest), run 2 on the same nodes, then run 1 again after a restart.

    The restart gives every node a fresh ``context.state`` (Flower keeps it in
    memory) and the server starts run 1 over from round 1.
    """
    first, _ = honest_run(run_id=1)
    second, _ = honest_run(run_id=2)
    second_out = Outcome(
        "second run on the same nodes", answers([second]), epsilons([first, second])
    )
    restart, _ = honest_run(run_id=1)  # fresh context.state, same disk
    restart_out = Outcome(
        "SuperNode restart, run 1 replayed from round 1",
        answers([restart]),
        epsilons([first, second, restart]),
    )
    return second_out, restart_out


class Proposing(TimeAdaptiveStrategy):
    """The honest wrapper proposing from an agreement the server rewrote."""

    def __init__(self, **claim: float) -> None:
        super().__init__(FedAvg(fraction_evaluate=0.0, min_available_nodes=2))
        self.claim = claim

    def _discover(self, grid: Grid, nodes: list[int]) -> None:
        super()._discover(grid, nodes)
        for client in self.clients.values():
            if client.privacy is None or client.schedule is None:
                continue
            changed = ClientPrivacy(**{**vars(client.privacy), **self.claim})
            try:
                client.schedule = changed.schedule()
            except ValueError:  # the claimed budget is beyond q = 1: ask for q = 1
                rounds = tuple(
                    dataclasses.replace(r, rate=1.0) for r in client.schedule.rounds
                )
                client.schedule = dataclasses.replace(client.schedule, rounds=rounds)


def strategy_server(strategy: TimeAdaptiveStrategy, rounds: int) -> ServerApp:
    """A ServerApp that starts ``strategy`` on the package's initial weights."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        X_test, _, n_classes = test_set(CONFIG)
        arrays = ArrayRecord(initial_params(CONFIG, X_test.shape[1], n_classes))
        strategy.start(grid=grid, initial_arrays=arrays, num_rounds=rounds)

    return app


def run_config_delta() -> tuple[Outcome, Outcome]:
    """delta = 0.5 in the run config; (a) nodes with epsilon only, (b) full nodes."""
    loose = AppConfig(**{**vars(CONFIG), "delta": 0.5})
    partial = node_contexts(
        2, loose.record(), **{str(i): {"epsilon": b} for i, b in enumerate(BUDGETS)}
    )
    a, _ = honest_run(loose, contexts=partial)
    out_a = Outcome(
        "run-config delta 0.5, node config epsilon only",
        answers([a], "query.dp_agreement") + answers([a]),
        epsilons([a]),
    )
    grid = LoopbackGrid(client_app, nodes(loose))
    with contextlib.suppress(ClientFailure):
        strategy_server(Proposing(delta=0.5), CONFIG.rounds)(grid, server_context())
    out_b = Outcome(
        "proposal planned at delta 0.5 (node agreed 1e-5)",
        answers([grid]),
        epsilons([grid]),
    )
    return out_a, out_b


def evaluate_probes() -> Outcome:
    """Crafted evaluate messages straight to the package app's nodes."""
    grid = LoopbackGrid(client_app, nodes())
    X_test, _, n_classes = test_set(CONFIG)
    for scale in (0.0, 1.0, -1.0):
        params = initial_params(CONFIG, X_test.shape[1], n_classes)
        arrays = ArrayRecord([p + scale for p in params])
        grid.send_and_receive([probe(node, arrays) for node in (100, 101)])
    return Outcome(
        "evaluate probes (crafted weights)",
        answers([grid], "evaluate"),
        epsilons([grid], private_evaluate=True),
    )


def probe(node: int, arrays: ArrayRecord, kind: str = "evaluate") -> Message:
    """A message of the server's choice to ``node``."""
    return Message(
        content=RecordDict({"arrays": arrays, "config": ConfigRecord()}),
        message_type=kind,
        dst_node_id=node,
    )


def duplicate_messages(
    send: Callable[[list[Message]], list[Message]], node_ids: list[int]
) -> dict[int, float]:
    """Agreement query, then two train messages for round 1 per node in one batch.

    Returns each node's budget, as its agreement states it.
    """
    strategy = TimeAdaptiveStrategy(FedAvg(min_available_nodes=len(node_ids)))
    X_test, _, n_classes = test_set(CONFIG)

    class Once:
        def send_and_receive(self, messages, timeout=None):  # type: ignore[no-untyped-def]
            return send(list(messages))

        def get_node_ids(self) -> list[int]:
            return node_ids

    strategy._discover(Once(), node_ids)  # type: ignore[arg-type]
    batch = []
    for node in node_ids:
        step = strategy.clients[node].schedule.rounds[0]  # type: ignore[union-attr]
        cfg = {records.ROUND: 1, records.RATE: step.rate,
               records.SIGMA: step.sigma, records.STEPS: step.steps,
               "server-round": 1}  # fmt: skip
        for _ in range(2):
            batch.append(
                Message(
                    content=RecordDict(
                        {
                            "arrays": ArrayRecord(
                                initial_params(CONFIG, X_test.shape[1], n_classes)
                            ),
                            "config": ConfigRecord(dict(cfg)),
                        }
                    ),
                    message_type="train",
                    dst_node_id=node,
                )
            )
    send(batch)
    return {
        node: client.privacy.epsilon
        for node, client in strategy.clients.items()
        if client.privacy is not None
    }


def duplicate_rounds_loopback() -> Outcome:
    """Two round-1 messages per node in one batch, in-process."""
    grid = LoopbackGrid(client_app, nodes())
    duplicate_messages(lambda m: list(grid.send_and_receive(m)), [100, 101])
    return Outcome(
        "duplicate round in one batch (in-process)", answers([grid]), epsilons([grid])
    )


def duplicate_rounds_simulation(state_dir: str) -> tuple[Outcome, list[Message]]:
    """The same in Flower's simulation: two Ray actors handle one node at once.

    Returns the outcome and the train replies. The simulated nodes' agreements
    come from the ClientApp's fixed config (the simulation's stand-in).
    """
    import os

    from flwr.simulation import run_simulation

    sent: list[Message] = []
    got: list[Message] = []
    failures: list[BaseException] = []
    budgets: dict[int, float] = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        import time

        node_ids: list[int] = []
        for _ in range(300):  # the simulated SuperNodes register first
            node_ids = sorted(grid.get_node_ids())
            if len(node_ids) >= 2:
                break
            time.sleep(0.2)

        def send(messages: list[Message]) -> list[Message]:
            replies = list(grid.send_and_receive(messages, timeout=300))
            by_id = {r.metadata.reply_to_message_id: r for r in replies}
            if messages and messages[0].metadata.message_type == "train":
                sent.extend(messages)
                got.extend(by_id[m.metadata.message_id] for m in messages)
            return replies

        try:
            budgets.update(duplicate_messages(send, node_ids))
        except BaseException as error:
            failures.append(error)
            raise

    saved = os.environ.get("DEFENSE_SUITE_STATE_DIR")
    os.environ["DEFENSE_SUITE_STATE_DIR"] = state_dir
    try:
        run_simulation(
            server_app=app,
            client_app=make_client_app(CONFIG),
            num_supernodes=2,
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"num_cpus": 2, "logging_level": "ERROR"},
            },
        )
    finally:
        if saved is not None:
            os.environ["DEFENSE_SUITE_STATE_DIR"] = saved
    if failures:
        raise failures[0]
    pairs = list(zip(sent, got, strict=True))
    node_ids = sorted(budgets, key=budgets.__getitem__)  # budgets 1, then 3
    eps = [true_epsilon(pairs, n) for n in node_ids]
    answered = [r.error.reason if r.has_error() else "released" for r in got]
    return Outcome("duplicate round in one batch (simulation, 2 actors)", answered,
                   eps), got  # fmt: skip


def table() -> list[Outcome]:
    """Every fast attack's outcome (each on fresh node storage)."""
    import os
    import tempfile

    rows: list[Outcome] = []

    def fresh() -> None:
        os.environ["DEFENSE_SUITE_STATE_DIR"] = tempfile.mkdtemp()

    fresh()
    rows.append(noise_replay()[0])
    fresh()
    rows.extend(second_run_and_restart())
    fresh()
    rows.extend(run_config_delta())
    fresh()
    rows.append(evaluate_probes())
    fresh()
    rows.append(duplicate_rounds_loopback())
    rows.append(duplicate_rounds_simulation(tempfile.mkdtemp())[0])
    from tests.federated import redteam_release

    rows.extend(redteam_release.table())
    return rows


if __name__ == "__main__":
    import logging

    from flwr.supercore.task_identity import TaskIdentity

    logging.disable(logging.WARNING)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    for outcome in table():
        sys.stdout.write(outcome.row() + "\n")
