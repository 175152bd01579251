"""A malicious ServerApp tries to make clients overspend; every client refuses.

The ServerApp and ClientApp are real Flower objects (the transport is
:class:`tests.federated.loopback.LoopbackGrid`). The clients' budgets come from their
node configs; the server tampers with the proposals of an otherwise honest
:class:`TimeAdaptiveStrategy`.
"""

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from defense_suite.federated.accounting import epsilon
from defense_suite.federated.flower import (
    ClientFailure,
    ClientPrivacy,
    TimeAdaptiveClient,
    TimeAdaptiveStrategy,
    node_privacy,
    records,
)
from tests.federated.loopback import LoopbackGrid, node_contexts, user_app

ROUNDS = 3
BUDGETS = (1.0, 3.0)
NODE = {
    str(i): {"epsilon": b, "delta": 1e-5, "rounds": ROUNDS, "local-steps": 4,
             "sigma": 1.0, "spending": "time-adaptive", "save-fraction": 0.5,
             "save-ratio": 0.7, "accountant": "rdp", "ledger-init": True}
    for i, b in enumerate(BUDGETS)
}  # fmt: skip
"""Each SuperNode's full agreement, as a deployment needs it (no run config read)."""


pytestmark = pytest.mark.usefixtures("task_identity")


def counting_app(trained):
    """A user's ClientApp: the mod, the agreement query, a train that counts."""

    def train(msg, context, rnd):
        trained.append((context.node_id, rnd.server_round))
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        metrics = MetricRecord({"num-examples": 10})
        content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    return user_app(train)


class Tampering(TimeAdaptiveStrategy):
    """The honest wrapper, then ``tamper(round, config)`` on every proposal."""

    def __init__(self, tamper, inflate=None):
        super().__init__(FedAvg(fraction_evaluate=0.0, min_available_nodes=2))
        self.tamper = tamper
        self.inflate = inflate

    def _discover(self, grid, nodes):
        super()._discover(grid, nodes)
        if self.inflate is not None:  # propose from a budget the server made up
            for client in self.clients.values():
                claimed = {**vars(client.privacy), "epsilon": self.inflate}
                bigger = ClientPrivacy(**claimed)
                client.schedule = bigger.schedule()

    def configure_train(self, server_round, arrays, config, grid):
        messages = list(super().configure_train(server_round, arrays, config, grid))
        for msg in messages:
            self.tamper(server_round, msg.content["config"])
        return messages


def malicious_server(strategy, rounds):
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord([np.zeros(3)]),
            num_rounds=rounds,
        )

    return app


def attack(tamper, rounds=ROUNDS, inflate=None):
    trained = []
    grid = LoopbackGrid(counting_app(trained), node_contexts(2, **NODE))
    server = malicious_server(Tampering(tamper, inflate), rounds)
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}
    )
    with pytest.raises(ClientFailure) as failure:
        server(grid, context)
    refused = [r for r in grid.replies if r.has_error()]
    assert refused, "no client refused"
    for reply in refused:
        assert not reply.has_content()  # no update left the client
    return failure.value, refused, trained, grid


def _last(rnd, cfg, key, value, at=1):
    if rnd == at:
        if value is None:
            del cfg[key]
        else:
            cfg[key] = value(cfg[key]) if callable(value) else value


@pytest.mark.parametrize(
    ("key", "value", "why", "category"),
    [
        (records.RATE, lambda q: 2 * q, "less private than the client's own",
         "less-private-than-agreed"),
        (records.RATE, 1.0, "less private than the client's own",
         "less-private-than-agreed"),
        (records.SIGMA, lambda s: 0.9 * s, "less private than the client's own",
         "less-private-than-agreed"),
        (records.SIGMA, 0.3, "less private", "less-private-than-agreed"),
        (records.SIGMA, 0.0, "sigma must be > 0", "bad-request"),
        (records.SIGMA, -1.0, "sigma must be > 0", "bad-request"),
        (records.SIGMA, None, "sigma is missing", "bad-request"),
        (records.RATE, 0.0, "rate must lie in (0, 1]", "bad-request"),
        (records.RATE, 1.5, "rate must lie in (0, 1]", "bad-request"),
        (records.STEPS, 50, "less private than the client's own",
         "less-private-than-agreed"),
        (records.STEPS, 0, "steps must be >= 1", "bad-request"),
    ],
)  # fmt: skip
def test_a_tampered_round_is_refused_before_any_training(
    key, value, why, category, caplog
):
    error, refused, trained, _ = attack(lambda r, c: _last(r, c, key, value))
    assert trained == []  # the user's train function never ran
    for reply in refused:  # the server learns the category only
        assert reply.error.reason == f"refused: {category}"
    # the node's own log has the details
    logged = [
        r.getMessage() for r in caplog.records if "round 1 refused" in r.getMessage()
    ]
    assert len(logged) == 2
    for line in logged:
        assert why in line
        assert "budget epsilon=" in line
        assert "rate=" in line
    assert "round 1" in str(error)


def test_the_issues_example_rate_one_sigma_low_is_refused(caplog):
    def tamper(rnd, cfg):
        cfg[records.RATE], cfg[records.SIGMA] = 1.0, 0.3

    _, refused, trained, _ = attack(tamper)
    assert trained == []
    assert len(refused) == 2
    assert any("rate=1.0, sigma=0.3" in r.getMessage() for r in caplog.records)


def test_a_replayed_round_is_refused():
    first = {}

    def replay(rnd, cfg):
        if rnd == 1:
            first.update(dict(cfg))
        if rnd == 2:
            for key in records.REQUEST_KEYS:
                cfg[key] = first[key]

    _, refused, trained, _ = attack(replay)
    assert sorted(trained) == [(100, 1), (101, 1)]  # round 1 only
    assert all(r.error.reason == "refused: replayed-round" for r in refused)


def test_rounds_beyond_the_plan_are_refused():
    last = {}

    def beyond(rnd, cfg):
        if rnd <= ROUNDS:
            last.update(dict(cfg))
        if rnd == ROUNDS + 1:  # the honest wrapper would not ask; this one does
            for key in records.REQUEST_KEYS:
                cfg[key] = last[key]
            cfg[records.ROUND] = rnd

    class Beyond(Tampering):
        def configure_train(self, server_round, arrays, config, grid):
            if server_round <= ROUNDS:
                return super().configure_train(server_round, arrays, config, grid)
            saved = {c.node_id: c.schedule for c in self.clients.values()}
            for client in self.clients.values():
                rounds = client.schedule.rounds + client.schedule.rounds[-1:]
                client.schedule = type(client.schedule)(
                    client.schedule.budget, client.schedule.delta, rounds
                )
            try:
                return super().configure_train(server_round, arrays, config, grid)
            finally:
                for client in self.clients.values():
                    client.schedule = saved[client.node_id]

    trained = []
    grid = LoopbackGrid(counting_app(trained), node_contexts(2, **NODE))
    server = malicious_server(Beyond(beyond), ROUNDS + 1)
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}
    )
    with pytest.raises(ClientFailure, match=f"round {ROUNDS + 1}"):
        server(grid, context)
    refused = [r for r in grid.replies if r.has_error()]
    assert len(refused) == 2
    assert all(r.error.reason == "refused: beyond-agreed-rounds" for r in refused)
    assert len(trained) == 2 * ROUNDS


def test_a_bigger_budget_from_the_server_is_refused(caplog):
    def claim(rnd, cfg):
        cfg["budgets"] = "10,10"
        cfg["epsilon"] = 10.0

    _, refused, trained, _ = attack(claim, inflate=10.0)
    assert trained == []
    for reply in refused:
        assert reply.error.reason == "refused: less-private-than-agreed"
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "budget epsilon=1," in logged
    assert "budget epsilon=3," in logged


def test_refused_rounds_are_not_charged_and_epsilon_is_the_clients_own():
    _, _, _, grid = attack(lambda r, c: _last(r, c, records.SIGMA, 0.5, at=2))
    for _node, context in grid.contexts.items():
        privacy = node_privacy(context)
        ledger = TimeAdaptiveClient(privacy, context).ledger
        assert [g.server_round for g in ledger.answered] == [1]
        own = privacy.schedule()
        assert ledger.epsilon == pytest.approx(epsilon(own.history(1), 1e-5))
        assert ledger.epsilon < privacy.epsilon
    honest = [r for r in grid.replies if not r.has_error() and r.content.metric_records]
    for reply in honest:
        metrics = next(iter(reply.content.metric_records.values()))
        assert records.EPSILON not in metrics  # stripped before aggregation


def test_an_honest_run_with_the_wrapper_completes_within_budgets():
    trained = []
    grid = LoopbackGrid(counting_app(trained), node_contexts(2, **NODE))
    strategy = Tampering(lambda r, c: None)
    server = malicious_server(strategy, ROUNDS)
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}
    )
    server(grid, context)
    assert len(trained) == 2 * ROUNDS
    summary = strategy.final_summary()
    for row in summary:
        assert 0.99 * row["budget"] <= row["epsilon"] <= row["budget"]
