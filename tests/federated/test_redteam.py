"""Red team: a competent malicious server against the clients' lifetime budgets.

Each attack of issue #25 is played by a real ServerApp (see
:mod:`tests.federated.redteam`) and judged by the client's true epsilon,
recomputed with Opacus from what the client actually released; every client must
stay within its lifetime budget, or refuse before anything leaves it. The
simulation with two Ray actors is slow (``--runslow``); everything else is
in-process.
"""

import json
import math
import multiprocessing
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from defense_suite.federated.flower import (
    ClientPrivacy,
    TimeAdaptiveClient,
    TimeAdaptiveMod,
    node_privacy,
    records,
)
from defense_suite.federated.flower.app import client_data
from defense_suite.federated.ledger import Grant, RoundRefused
from defense_suite.federated.store import LedgerFile, LedgerUnavailable
from tests.federated import redteam
from tests.federated.loopback import LoopbackGrid, node_contexts, user_app

pytestmark = pytest.mark.usefixtures("task_identity")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower-own-model"


def within_budgets(epsilons):
    for eps, budget in zip(epsilons, redteam.BUDGETS, strict=True):
        assert eps <= budget


def test_noise_replay_is_off_by_the_noise_scale():
    outcome, residual = redteam.noise_replay()
    # two independent Gaussian draws differ by about sqrt(2) x the noise scale
    assert 1.0 < residual < 2.0
    within_budgets(outcome.epsilons)
    assert all(
        0.9 * b <= e for e, b in zip(outcome.epsilons, redteam.BUDGETS, strict=True)
    )


def test_the_replay_works_when_the_node_opts_into_a_research_seed(simulated):
    # the control: the attack is real, and the research seed is what it needs
    _, residual = redteam.noise_replay(research_seed=True)
    assert residual < 1e-9


def test_a_research_seed_is_refused_in_a_deployment(caplog):
    grid, error = redteam.honest_run(contexts=redteam.nodes(**{"research-seed": 0}))
    assert error is not None
    assert set(redteam.answers([grid])) == {"refused: node-config"}
    assert redteam.epsilons([grid]) == [0.0, 0.0]
    assert any("research-seed" in r.getMessage() for r in caplog.records)
    for context in grid.contexts.values():  # refused before anything was charged
        privacy = node_privacy(context)
        assert TimeAdaptiveClient(privacy, context).ledger.history() == []


def test_a_second_run_and_a_restart_are_refused_once_the_budget_is_spent():
    second, restart = redteam.second_run_and_restart()
    assert {a.split(" (")[0] for a in second.answers} == {"refused: over-budget"}
    assert all(" of budget " in a for a in second.answers)
    assert set(restart.answers) == {"refused: replayed-round"}
    within_budgets(second.epsilons)
    within_budgets(restart.epsilons)


def test_a_delta_from_the_run_config_is_never_used():
    partial, proposal = redteam.run_config_delta()
    assert set(partial.answers) == {"refused: node-config"}  # nothing trained
    assert set(proposal.answers) == {"refused: less-private-than-agreed"}
    assert partial.epsilons == proposal.epsilons == [0.0, 0.0]


def test_missing_key_error_is_one_line_naming_it():
    context = node_contexts(1, {"delta": 0.5}, **{"0": {"epsilon": 1.0}})[100]
    with pytest.raises(records.MissingKey) as missing:
        node_privacy(context)
    assert "'delta'" in str(missing.value)
    assert "\n" not in str(missing.value)


def test_evaluate_probes_are_refused():
    outcome = redteam.evaluate_probes()
    assert set(outcome.answers) == {"refused: evaluate-refused"}
    assert outcome.epsilons == [0.0, 0.0]


def test_a_duplicate_round_in_one_batch_is_granted_once():
    outcome = redteam.duplicate_rounds_loopback()
    assert sorted(outcome.answers) == ["refused: replayed-round"] * 2 + ["released"] * 2
    within_budgets(outcome.epsilons)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_duplicate_round_in_the_simulation_with_two_actors_is_granted_once(
    tmp_path,
):
    outcome, replies = redteam.duplicate_rounds_simulation(str(tmp_path))
    assert len(replies) == 4
    assert sorted(outcome.answers) == ["refused: replayed-round"] * 2 + ["released"] * 2
    within_budgets(outcome.epsilons)
    for ledger in tmp_path.glob("ledger-partition-*.json"):
        assert len(json.loads(ledger.read_text())["grants"]) == 1


def _raising_app(error):
    def train(msg, context, rnd):
        raise error

    return user_app(train)


def test_exception_text_is_not_sent_to_the_server(caplog):
    secret = "record 17 has feature value 0.4242"
    grid = LoopbackGrid(_raising_app(ValueError(secret)), redteam.nodes())
    with pytest.raises(Exception, match="client error"):
        redteam.strategy_server(redteam.Proposing(), 1)(grid, redteam.server_context())
    for reply in grid.replies:
        if reply.has_error():
            assert secret not in reply.error.reason
            assert reply.error.reason in ("client error",)
    assert any(secret in (r.exc_text or "") + r.getMessage() for r in caplog.records)
    # the failed round was granted: it stays charged on the node's disk
    context = grid.contexts[100]
    assert TimeAdaptiveClient(node_privacy(context), context).ledger.answered


def test_train_replies_carry_only_accounted_metrics():
    grid, error = redteam.honest_run()
    assert error is None
    for sent, reply in zip(grid.sent, grid.replies, strict=True):
        if sent.metadata.message_type != "train":
            continue
        (metrics,) = reply.content.metric_records.values()
        # (the wrapper strips dp-epsilon and dp-budget once it has logged them)
        assert set(metrics) <= {"num-examples", records.EPSILON, records.BUDGET}
        # the node's public count, not the true size
        assert metrics["num-examples"] == redteam.PUBLIC
        pid = sent.metadata.dst_node_id - 100
        assert len(client_data(redteam.CONFIG, pid, 2)) != redteam.PUBLIC
        assert not reply.content.config_records


def test_unaccounted_metrics_are_dropped(caplog):
    def train(msg, context, rnd):
        metrics = MetricRecord({"num-examples": 137, "train-loss": 0.31})
        extra = ConfigRecord({"labels": "3,3,1"})
        content = RecordDict(
            {"arrays": msg.content["arrays"], "metrics": metrics, "extra": extra}
        )
        return Message(content=content, reply_to=msg)

    grid = LoopbackGrid(user_app(train), redteam.nodes(**{"public-num-examples": 100}))
    redteam.strategy_server(redteam.Proposing(), 1)(grid, redteam.server_context())
    for sent, reply in zip(grid.sent, grid.replies, strict=True):
        if sent.metadata.message_type == "train":
            assert set(reply.content) == {"arrays", "metrics"}
            assert reply.content["metrics"]["num-examples"] == 100
            assert "train-loss" not in reply.content["metrics"]
    assert any("metrics.train-loss" in r.getMessage() for r in caplog.records)


def test_other_queries_are_not_served():
    mod = TimeAdaptiveMod(node_privacy)
    app = mod.register(ClientApp(mods=[mod]))
    asked = []

    @app.query("labels")
    def labels(msg, context):  # a user's own query: the mod answers it first
        asked.append(1)
        return Message(content=RecordDict(), reply_to=msg)

    grid = LoopbackGrid(app, redteam.nodes())
    arrays = ArrayRecord([np.zeros(2)])
    (reply,) = grid.send_and_receive([redteam.probe(100, arrays, "query.labels")])
    assert reply.error.reason == "refused: not-served"
    assert asked == []


# -- the ledger on disk -------------------------------------------------------

PRIVACY = ClientPrivacy(epsilon=1.0, delta=1e-5, rounds=2, steps=1, sigma=1.0,
                        spending="uniform")  # fmt: skip


def _decide(ledger):
    own = PRIVACY.schedule().rounds[0]
    return ledger.check(1, own.rate, own.sigma, own.steps)


@pytest.mark.parametrize("damage", ["missing", "garbage", "edited", "other-budget"])
def test_a_missing_corrupt_or_tampered_ledger_refuses_to_train(tmp_path, damage):
    path = tmp_path / "ledger.json"
    LedgerFile(path, create=True).charge(PRIVACY, 1, _decide)
    if damage == "missing":
        path.unlink()
    elif damage == "garbage":
        path.write_text(path.read_text()[:40])
    elif damage == "edited":  # a grant removed to win back budget
        data = json.loads(path.read_text())
        data["grants"] = []
        path.write_text(json.dumps(data))
    store = LedgerFile(path, create=False)
    privacy = PRIVACY
    if damage == "other-budget":
        privacy = ClientPrivacy(**{**vars(PRIVACY), "epsilon": 5.0})
    with pytest.raises(LedgerUnavailable):
        store.charge(privacy, 2, _decide)
    with pytest.raises(LedgerUnavailable):
        store.ledger(privacy, 2)


def test_a_missing_ledger_refuses_on_a_supernode_without_ledger_init():
    contexts = redteam.nodes(**{"ledger-init": False})
    grid, error = redteam.honest_run(contexts=contexts)
    assert error is not None
    assert set(redteam.answers([grid])) == {"refused: ledger-unavailable"}


def test_the_ledger_is_written_atomically_with_a_digest(tmp_path):
    path = tmp_path / "node" / "ledger.json"
    grant, ledger = LedgerFile(path, create=True).charge(PRIVACY, 7, _decide)
    data = json.loads(path.read_text())
    assert data["grants"] == [{"run": 7, "round": 1, "rate": grant.rate,
                               "sigma": 1.0, "steps": 1}]  # fmt: skip
    assert len(data["sha256"]) == 64
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "ledger.json",
        "ledger.json.lock",
    ]  # no temporary file left behind
    assert ledger.answered == [grant]
    assert LedgerFile(path, create=False).ledger(PRIVACY, 8).earlier == [grant]


def _charge_in_process(path, queue):
    try:
        LedgerFile(path, create=True).charge(PRIVACY, 1, _decide)
        queue.put("granted")
    except RoundRefused as refused:
        queue.put(refused.category)


def test_concurrent_processes_are_granted_one_round_once(tmp_path):
    path = str(tmp_path / "ledger.json")
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    procs = [
        context.Process(target=_charge_in_process, args=(path, queue)) for _ in range(4)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    got = sorted(queue.get(timeout=10) for _ in procs)
    assert got == ["granted"] + ["replayed-round"] * 3
    assert len(json.loads(Path(path).read_text())["grants"]) == 1


# -- the example app (a user's CNN with Opacus) ------------------------------


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from own_model import client_app

    yield client_app.app
    for name in [m for m in sys.modules if m.startswith("own_model")]:
        del sys.modules[name]


def _example_config():
    import tomllib

    with open(EXAMPLE / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    return {**config, "num-server-rounds": 2, "local-steps": 2}


def _example_round(app, node_dir, monkeypatch):
    """One granted round of the example on a fresh node; the released arrays."""
    monkeypatch.setenv("DEFENSE_SUITE_STATE_DIR", str(node_dir))
    config = _example_config()
    context = node_contexts(3, config)[100]
    privacy = app_privacy(context)
    own = privacy.schedule().rounds[0]
    torch.manual_seed(0)
    from own_model.task import SmallCNN

    cfg = ConfigRecord(
        {records.ROUND: 1, records.RATE: own.rate, records.SIGMA: own.sigma,
         records.STEPS: own.steps}
    )  # fmt: skip
    msg = Message(
        content=RecordDict(
            {"arrays": ArrayRecord(SmallCNN().state_dict()), "config": cfg}
        ),
        message_type="train",
        dst_node_id=100,
    )
    reply = app(msg, context)
    assert not reply.has_error(), reply.error.reason
    return np.concatenate(
        [a.ravel() for a in reply.content["arrays"].to_numpy_ndarrays()]
    ), own


def app_privacy(context):
    from own_model.client_app import privacy

    return privacy(context)


def test_the_examples_noise_is_not_a_function_of_what_the_server_knows(
    example, tmp_path, monkeypatch, simulated
):
    # same weights, data, node, round and run config: the server knows all of it
    a, own = _example_round(example, tmp_path / "a", monkeypatch)
    b, _ = _example_round(example, tmp_path / "b", monkeypatch)
    config = _example_config()
    n = 1437 * 8 // 10 // 3  # the node's share of the training images (about)
    batch = max(1, round(own.rate * n))
    one_step = config["lr"] * own.sigma * config["clip"] / batch
    # two independent noise draws: the releases differ by about the noise scale
    assert np.linalg.norm(a - b) > 0.5 * one_step * math.sqrt(a.size)


def test_the_example_evaluates_on_the_public_split_only(example, simulated):
    config = _example_config()
    contexts = node_contexts(3, config)
    from own_model.task import SmallCNN

    torch.manual_seed(1)
    arrays = ArrayRecord(SmallCNN().state_dict())
    grid = LoopbackGrid(example, contexts)
    replies = grid.send_and_receive([redteam.probe(n, arrays) for n in contexts])
    metrics = [dict(next(iter(r.content.metric_records.values()))) for r in replies]
    # three nodes with different private images answer identically: no leak
    assert metrics[0] == metrics[1] == metrics[2]
    assert metrics[0]["num-examples"] == 360  # the public held-out split


def test_the_mod_refuses_evaluate_unless_the_node_opts_in():
    trained = []
    privacy = ClientPrivacy(epsilon=1.0, delta=1e-5, rounds=2, steps=1, sigma=1.0)
    mod = TimeAdaptiveMod(
        lambda context: privacy,
        training_records=lambda context: np.zeros((3, 2)),
        public_records=lambda context: np.ones((2, 2)),
    )
    app = ClientApp(mods=[mod])

    @app.evaluate()
    def evaluate(msg, context):
        trained.append(1)
        return Message(content=RecordDict(), reply_to=msg)

    arrays = ArrayRecord([np.zeros(2)])
    plain = node_contexts(1)[100]
    assert app(redteam.probe(100, arrays), plain).error.reason == (
        "refused: evaluate-refused"
    )
    assert trained == []
    opted = node_contexts(1, **{"0": {"evaluate": "public", "ledger-init": True}})[100]
    assert not app(redteam.probe(100, arrays), opted).has_error()
    assert trained == [1]


def test_grant_is_tied_to_its_message():
    context = node_contexts(1, **{"0": redteam.agreement(1.0)})[100]
    privacy = node_privacy(context)
    own = privacy.schedule().rounds[0]
    client = TimeAdaptiveClient(privacy, context)
    cfg = ConfigRecord(
        {records.ROUND: 1, records.RATE: own.rate, records.SIGMA: own.sigma,
         records.STEPS: own.steps}
    )  # fmt: skip
    msg = Message(
        content=RecordDict({"arrays": ArrayRecord([np.zeros(1)]), "config": cfg}),
        message_type="train",
        dst_node_id=100,
    )
    first = client.grant(msg)
    assert client.round(msg).grant == first.grant  # the same message: its grant
    with pytest.raises(RoundRefused, match="already"):
        client.grant(msg)  # a replay of it: refused
    assert client.ledger.answered == [Grant(1, own.rate, own.sigma, own.steps)]
