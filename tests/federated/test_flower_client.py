"""The client-side API with a user's own torch model, and the ledger on its own."""

import logging

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg, FedProx

from defense_suite.federated.flower import (
    ClientPrivacy,
    PrivacyLedger,
    RoundRefused,
    TimeAdaptiveMod,
    TimeAdaptiveStrategy,
    records,
    runtime,
)
from defense_suite.federated.ledger import Grant
from tests.federated.loopback import LoopbackGrid, node_contexts, user_app

PRIVACY = {"delta": 1e-5, "rounds": 2, "local-steps": 3, "sigma": 1.0,
           "spending": "time-adaptive", "save-fraction": 0.5, "save-ratio": 0.7,
           "accountant": "rdp", "ledger-init": True}  # fmt: skip
NODES = {"0": {"epsilon": 2.0, **PRIVACY}, "1": {"epsilon": 6.0, **PRIVACY}}


pytestmark = pytest.mark.usefixtures("task_identity")


def torch_app(extra_steps=0):
    """A user's app: own nn.Module, own data, Opacus through the helper."""

    def train(msg, context, rnd):
        pid = int(context.node_config["partition-id"])
        g = torch.Generator().manual_seed(1000 * pid + rnd.server_round)
        X, y = torch.randn(64, 5, generator=g), torch.randint(0, 3, (64,), generator=g)
        net = torch.nn.Linear(5, 3)
        weights = msg.content["arrays"].to_torch_state_dict()
        net.load_state_dict(weights)
        model, optimizer, loader = rnd.make_private(
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            torch.utils.data.TensorDataset(X, y),
            max_grad_norm=1.0,
            public_examples=64,
        )
        steps = 0
        for xb, yb in rnd.batches(loader):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            steps += 1
        for _ in range(extra_steps):
            xb, yb = X[:8], y[:8]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        assert steps == rnd.steps
        state = ArrayRecord(net.state_dict())
        metrics = MetricRecord({"num-examples": 64, "steps": steps})
        return Message(
            content=RecordDict({"arrays": state, "metrics": metrics}), reply_to=msg
        )

    return user_app(train)


def run(app, inner, rounds=2):
    grid = LoopbackGrid(app, node_contexts(2, **NODES))
    strategy = TimeAdaptiveStrategy(inner)
    server = ServerApp()

    @server.main()
    def main(grid, context):
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(torch.nn.Linear(5, 3).state_dict()),
            num_rounds=rounds,
        )

    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}
    )
    server(grid, context)
    return strategy, grid


@pytest.mark.parametrize("inner", [FedAvg, FedProx])
def test_any_strategy_becomes_time_adaptive_with_a_torch_model(inner, caplog):
    caplog.set_level(logging.INFO, logger="flwr")
    strategy, _grid = run(torch_app(), inner(fraction_evaluate=0.0))
    summary = strategy.final_summary()
    assert [row["budget"] for row in summary] == [2.0, 6.0]
    for row in summary:
        assert 0.99 * row["budget"] <= row["epsilon"] <= row["budget"]
    # per-client epsilon against budget, every round, in Flower's log
    for rnd in (1, 2):
        for pid, budget in (("0", 2), ("1", 6)):
            assert any(
                f"round {rnd}: client {pid} spent epsilon" in r.getMessage()
                and f"budget {budget}" in r.getMessage()
                for r in caplog.records
            )
    assert any("client 0: epsilon" in r.getMessage() for r in caplog.records)


def test_the_optimizer_refuses_steps_past_the_grant():
    grid = LoopbackGrid(torch_app(extra_steps=1), node_contexts(2, **NODES))
    strategy = TimeAdaptiveStrategy(FedAvg(fraction_evaluate=0.0))
    arrays = ArrayRecord(torch.nn.Linear(5, 3).state_dict())
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    for reply in replies:
        assert reply.has_error()
        assert reply.error.reason == "refused: steps-exceeded"


def test_the_ledger_refuses_an_over_budget_round():
    privacy = ClientPrivacy(epsilon=1.0, delta=1e-5, rounds=4, steps=4, sigma=1.0)
    own = privacy.schedule().rounds
    ledger = PrivacyLedger(privacy)
    for t in (1, 2, 3):
        ledger.grant(t, own[t - 1].rate, own[t - 1].sigma, own[t - 1].steps)
    # a history from elsewhere (e.g. an earlier run) fills the budget
    crowded = PrivacyLedger.from_state(
        privacy,
        {"round": [1, 2], "rate": [own[-1].rate] * 2, "sigma": [1.0, 1.0],
         "steps": [40, 40]},
    )  # fmt: skip
    with pytest.raises(RoundRefused, match="over the budget") as refused:
        crowded.check(3, own[2].rate, own[2].sigma, own[2].steps)
    assert "round 3 refused" in str(refused.value)
    assert "budget epsilon=1" in str(refused.value)
    last = ledger.check(4, own[3].rate, own[3].sigma, own[3].steps)
    ledger.answered.append(last)
    assert 0.99 <= ledger.epsilon <= 1.0
    assert ledger.epsilon == pytest.approx(privacy.schedule().epsilon())
    assert ledger.accountant().history == ledger.history()


def test_the_mod_refuses_an_over_budget_round_before_user_code(caplog):
    trained = []
    privacy = ClientPrivacy(epsilon=1.0, delta=1e-5, rounds=4, steps=4, sigma=1.0)
    mod = TimeAdaptiveMod(lambda context: privacy)
    app = ClientApp(mods=[mod])

    @app.train()
    def train(msg, context):
        trained.append(1)
        return Message(content=RecordDict(), reply_to=msg)

    context = node_contexts(1, **{"0": {"ledger-init": True}})[100]
    own = privacy.schedule().rounds
    store = runtime.ledger_file(context)
    store.charge(privacy, 1, lambda ledger: Grant(1, own[-1].rate, 1.0, 200))
    cfg = ConfigRecord(
        {records.ROUND: 2, records.RATE: own[1].rate, records.SIGMA: 1.0,
         records.STEPS: 4}
    )  # fmt: skip
    msg = Message(
        content=RecordDict({"arrays": ArrayRecord([np.zeros(2)]), "config": cfg}),
        message_type="train",
        dst_node_id=100,
    )
    reply = app(msg, context)
    assert reply.has_error()
    assert reply.error.reason.startswith("refused: over-budget (spent epsilon ")
    assert reply.error.reason.endswith(" of budget 1)")
    assert any("over the budget" in r.getMessage() for r in caplog.records)
    assert trained == []
