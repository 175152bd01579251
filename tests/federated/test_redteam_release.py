"""Issue 37: every reply a DP release, whatever the server sends (attacks must fail)."""

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log

from defense_suite.federated.client import (
    LocalData,
    StepPlan,
    local_train,
)
from defense_suite.federated.flower import BudgetSpent, TimeAdaptiveMod
from defense_suite.federated.flower.app import client_app, client_data
from defense_suite.federated.flower.client import PrivateRound
from defense_suite.federated.flower.console import OneLineFailure, one_line_failures
from defense_suite.federated.ledger import ClientPrivacy, Grant, PrivacyLedger
from defense_suite.federated.padding import padded_rows
from defense_suite.federated.private_optimizer import SanitizingDPOptimizer
from defense_suite.federated.softmax import softmax_step
from tests.federated import redteam
from tests.federated import redteam_release as rr
from tests.federated import redteam_timing as timing
from tests.federated.loopback import LoopbackGrid, node_contexts, user_app

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.mark.parametrize("probe", rr.PROBES)
def test_overflow_probes_get_a_finite_update_in_every_round(probe):
    data = client_data(rr.PROBE_CONFIG, 0, 2)
    overflowed = rr.overflow_counts(data, probe)
    expected = {"one record": (1, 1), "every record": (len(data), len(data))}
    low, high = expected.get(probe, (len(data) // 5, 4 * len(data) // 5))
    assert low <= overflowed <= high  # the probe does overflow what it says
    grid, error = rr.overflow_run(probe)
    assert error is None
    assert redteam.answers([grid]) == ["released"] * 8  # 2 nodes x 4 rounds
    assert rr.finite_replies(grid)
    for eps, budget in zip(redteam.epsilons([grid]), rr.PROBE_BUDGETS, strict=True):
        assert 0 < eps <= budget


def test_neighbours_emit_the_same_transcript_to_the_overflow_probe(
    tmp_path, monkeypatch
):
    """With and without the one record the probe overflows: same kinds and shapes."""
    monkeypatch.setenv("DEFENSE_SUITE_STATE_DIR", str(tmp_path / "with"))
    with_target, error_a = rr.overflow_run("one record")
    monkeypatch.setenv("DEFENSE_SUITE_STATE_DIR", str(tmp_path / "without"))
    without, error_b = rr.overflow_run("one record", drop_target=True)
    assert error_a is None
    assert error_b is None
    assert rr.transcript(with_target) == rr.transcript(without)
    assert {t[0] for t in rr.transcript(with_target)} == {"reply"}
    assert rr.finite_replies(without)


def test_a_nonfinite_gradient_contributes_zero_before_clipping():
    data = client_data(rr.PROBE_CONFIG, 0, 2)
    (W, b), target = rr.crafted(data, "one record")
    keep = np.arange(len(data)) != target
    gW, gb = softmax_step(W, b, data.X, data.y, 1.0)
    hW, hb = softmax_step(W, b, data.X[keep], data.y[keep], 1.0)
    assert np.isfinite(gW).all()
    np.testing.assert_allclose(gW, hW, atol=1e-12)
    np.testing.assert_allclose(gb, hb, atol=1e-12)


@pytest.mark.parametrize("model", ["softmax", "mlp"])
@pytest.mark.parametrize("weight", [np.inf, np.nan, 1e308, -1e308])
def test_local_train_is_total_on_crafted_weights(model, weight):
    rng = np.random.default_rng(0)
    data = LocalData(rng.normal(size=(30, 4)), rng.integers(0, 3, 30), 3)
    if model == "softmax":
        params = [np.zeros((4, 3)), np.zeros(3)]
    else:
        params = [np.zeros((4, 5)), np.zeros(5), np.ones((5, 3)), np.zeros(3)]
    params[0][0, 0] = weight
    out = local_train(
        params, data, StepPlan(1.0, 2, 1.0), lr=0.1, clip=1.0,
        rng=np.random.default_rng(1), public_count=30,
    )  # fmt: skip
    assert [o.shape for o in out] == [p.shape for p in params]
    assert all(np.isfinite(o).all() for o in out)


def test_weights_of_another_width_are_refused_before_any_record_is_read():
    data = LocalData(np.zeros((4, 2)), np.array([0, 1, 2, 2]), 3)
    with pytest.raises(ValueError, match="k=3 classes"):
        local_train(
            [np.zeros((2, 2)), np.zeros(2)], data, StepPlan(0.5, 1, 1.0),
            lr=0.1, clip=1.0, rng=np.random.default_rng(0), public_count=4,
        )  # fmt: skip


def _module_and_batch(rows, labels):
    torch.manual_seed(0)
    from opacus import GradSampleModule

    net = GradSampleModule(torch.nn.Linear(3, 2).double(), loss_reduction="sum")
    X = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(labels)
    torch.nn.functional.cross_entropy(net(X), y, reduction="sum").backward()
    return net


def test_the_opacus_optimizer_zeroes_a_nonfinite_sample_before_clipping():
    rows = [[1.0, 2.0, 0.5], [np.inf, 0.0, 1.0], [0.3, -1.0, 2.0]]
    sums = []
    for batch, labels in ((rows, [0, 1, 1]), ([rows[0], rows[2]], [0, 1])):
        net = _module_and_batch(batch, labels)
        optimizer = SanitizingDPOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), noise_multiplier=1.0,
            max_grad_norm=1.0, expected_batch_size=3, loss_reduction="sum",
        )  # fmt: skip
        optimizer.clip_and_accumulate()
        sums.append([p.summed_grad.clone() for p in optimizer.params])
        if len(batch) == 3:
            assert optimizer.sanitized == 1
    for a, b in zip(*sums, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)


def _round(count):
    privacy = ClientPrivacy(epsilon=5.0, delta=1e-5, rounds=1, steps=2, sigma=1.0)
    return PrivateRound(
        Grant(1, 0.3, 1.0, 2), PrivacyLedger(privacy),
        np.random.default_rng(0), 0, count,
    )  # fmt: skip


@pytest.mark.parametrize("n", [445, 444])
def test_make_private_normalizes_by_the_public_count(n):
    net = torch.nn.Linear(3, 2).double()
    data = torch.utils.data.TensorDataset(
        torch.zeros(n, 3, dtype=torch.float64), torch.zeros(n, dtype=torch.long)
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    _, optimizer, _ = _round(445).make_private(net, opt, data, max_grad_norm=1.0)
    assert isinstance(optimizer, SanitizingDPOptimizer)
    assert optimizer.expected_batch_size == round(0.3 * 445)  # never from n
    with pytest.raises(ValueError, match="public-num-examples"):
        _round(None).make_private(net, opt, data, max_grad_norm=1.0)


def test_the_scale_attack_sees_no_difference_between_neighbours():
    """Pure-noise coordinates of 445- and 444-record clients, public count 445."""
    a, b = rr.noise_coordinates((445, 444), 60, 445, zero=1000)
    for sample in (a, b):  # each at the scale the public count predicts
        assert abs(np.std(sample) - 1.0) < 3 / np.sqrt(2 * sample.size)
    assert abs(rr.scale_z([a, b])) < rr.TOLD_APART


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_scale_attack_tells_the_private_size_apart_but_not_the_public_count():
    """Full power (4.8M noise coordinates each): the attack works on the old
    normalization by the private size and fails on the public count."""
    public = rr.scale_z(rr.noise_coordinates((445, 444), 400, 445))
    private = rr.scale_z(rr.noise_coordinates((445, 444), 400, None))
    assert abs(public) < rr.TOLD_APART
    assert abs(private) > rr.TOLD_APART
    opacus = rr.scale_z(rr.noise_coordinates((445, 444), 600, 445, "opacus"))
    assert abs(opacus) < rr.TOLD_APART


@pytest.mark.parametrize("n", [445, 444])
def test_the_opacus_path_takes_exactly_the_granted_steps(n):
    rng = np.random.default_rng(n)
    data = LocalData(rng.normal(size=(n, 6)), rng.integers(0, 3, n), 3)
    rr.opacus_noise(data, 0.3, 1.0, 1.0, 0.1, 445, np.random.default_rng(0))


def test_opacus_steps_compute_the_same_rows_whatever_the_sample_and_the_count():
    """The timing channel by construction: make_private's steps, instrumented,
    compute the public padded_rows(q, N) rows for nodes of 60, 444, 445 and 600
    records under one public count, while the records sampled vary with n."""
    seen = timing.opacus_rows((60, 444, 445, 600))
    rows = padded_rows(timing.Q, timing.PUBLIC)
    for computed, sampled in seen.values():
        assert computed == [rows] * timing.STEPS
        assert all(0 <= s <= rows for s in sampled)
    total = {n: sum(sampled) for n, (_, sampled) in seen.items()}
    assert total[60] < total[600] / 3  # what the old path's work followed


def test_evaluate_on_a_split_the_server_chooses_is_answered_on_the_nodes_own():
    row, overlaps = rr.server_chosen_split()
    assert overlaps["server"] > 0  # the attack's target held charged records
    assert overlaps["answered"] == 0
    assert all(a.startswith("released; the node's own split") for a in row.answers)
    assert not any("MISMATCH" in a for a in row.answers)


def test_evaluate_is_refused_when_the_nodes_split_holds_charged_records():
    row = rr.moved_split()
    assert row.answers == ["refused: evaluate-refused"] * 2


def test_simulated_evaluate_is_refused_unless_declared_disjoint(simulated):
    contexts = node_contexts(2, redteam.CONFIG.record(), **{"0": {"evaluate": "public"},
        "1": {"evaluate": "public", "public-split-disjoint": True}})  # fmt: skip
    grid = LoopbackGrid(client_app, contexts)
    params = [np.zeros((64, 10)), np.zeros(10)]
    grid.send_and_receive([redteam.probe(n, ArrayRecord(params)) for n in (100, 101)])
    assert redteam.answers([grid], "evaluate") == [
        "refused: evaluate-refused", "released"
    ]  # fmt: skip


def test_a_mod_without_a_declared_public_split_refuses_evaluate():
    privacy = ClientPrivacy(epsilon=1.0, delta=1e-5, rounds=2, steps=1, sigma=1.0)
    mod = TimeAdaptiveMod(lambda context: privacy, evaluate="public")
    context = node_contexts(1, **{"0": {"ledger-init": True}})[100]
    reply = mod(redteam.probe(100, ArrayRecord([np.zeros(2)])), context, None)
    assert reply.error.reason == "refused: evaluate-refused"


def test_a_spent_budget_stops_the_run_with_one_line(caplog):
    spent = redteam.honest_run()[0]
    assert redteam.answers([spent]) == ["released"] * 4
    _, error = redteam.honest_run(run_id=2)
    assert isinstance(error, BudgetSpent)
    line = str(error)
    assert "\n" not in line
    assert "client 0" in line or "client 1" in line
    assert "refused: over-budget (spent epsilon " in line
    assert " of budget " in line


def test_flowers_traceback_of_a_stopped_run_becomes_one_line():
    one_line_failures()
    one_line_failures()  # idempotent
    flwr = logging.getLogger("flwr")
    assert sum(isinstance(f, OneLineFailure) for f in flwr.filters) == 1
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(self.format(record))

    handler = Keep()
    flwr.addHandler(handler)
    try:
        try:
            try:
                raise BudgetSpent("round 2: client 0 (node 100): refused: over-budget")
            except BudgetSpent as inner:
                raise RuntimeError("An error was encountered") from inner
        except RuntimeError as outer:
            log(logging.ERROR, "Simulation raised an exception", exc_info=outer)
        try:
            raise KeyError("unrelated")
        except KeyError as other:
            log(logging.ERROR, "ServerApp raised an exception", exc_info=other)
    finally:
        flwr.removeHandler(handler)
    assert seen[0] == (
        "run stopped: round 2: client 0 (node 100): refused: over-budget"
    )
    assert "Traceback" in seen[1]  # other exceptions keep their traceback


def _opacus_app(X, y):
    """A user's app on the Opacus path (mod, helper, make_private) over (X, y)."""
    from flwr.app import Message, MetricRecord, RecordDict

    from defense_suite.federated.flower import node_privacy

    mod = TimeAdaptiveMod(node_privacy)

    def train(msg, context, rnd):
        net = torch.nn.Linear(X.shape[1], 3)
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        model, optimizer, loader = rnd.make_private(
            net, torch.optim.SGD(net.parameters(), lr=0.1),
            torch.utils.data.TensorDataset(X, y), max_grad_norm=1.0,
            public_examples=mod.public_examples(context),
        )  # fmt: skip
        for xb, yb in rnd.batches(loader):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        content = RecordDict(
            {"arrays": ArrayRecord(net.state_dict()),
             "metrics": MetricRecord({"num-examples": 1})}
        )  # fmt: skip
        return Message(content=content, reply_to=msg)

    return user_app(train, mod)


def test_neighbours_on_the_opacus_path_emit_the_same_transcript(tmp_path, monkeypatch):
    """A float32 weight of 3e38 / t overflows the logits of the one record with
    x_0 > t; with and without that record: released, finite, same structure."""
    from flwr.serverapp.strategy import FedAvg

    from defense_suite.federated.flower import TimeAdaptiveStrategy

    g = torch.Generator().manual_seed(0)
    X = torch.rand(60, 5, generator=g)
    X[7, 0] = 5.0  # the target: the only record above t = 2
    y = torch.randint(0, 3, (60,), generator=g)
    crafted = torch.nn.Linear(5, 3).state_dict()
    crafted["weight"][0, 0] = 3e38 / 2.0
    probe = torch.nn.Linear(5, 3)
    probe.load_state_dict(crafted)
    with torch.no_grad():
        overflowed = ~torch.isfinite(probe(X)).all(dim=1)
    assert overflowed.nonzero().flatten().tolist() == [7]
    agreement = {"epsilon": 8.0, "delta": 1e-5, "rounds": 3, "local-steps": 2,
                 "sigma": 1.0, "spending": "uniform", "accountant": "rdp",
                 "ledger-init": True, "public-num-examples": 60}  # fmt: skip
    transcripts = []
    for name, keep in (("with", slice(None)), ("without", torch.arange(60) != 7)):
        monkeypatch.setenv("DEFENSE_SUITE_STATE_DIR", str(tmp_path / name))
        grid = LoopbackGrid(
            _opacus_app(X[keep], y[keep]), node_contexts(1, **{"0": agreement})
        )
        inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)
        strategy = TimeAdaptiveStrategy(inner)
        for rnd in (1, 2, 3):
            arrays = ArrayRecord(crafted)
            messages = list(strategy.configure_train(rnd, arrays, ConfigRecord(), grid))
            grid.send_and_receive(messages)
        assert redteam.answers([grid]) == ["released"] * 3
        assert rr.finite_replies(grid)
        trains = [r for m, r in zip(grid.sent, grid.replies, strict=True)
                  if m.metadata.message_type == "train"]  # fmt: skip
        for reply in trains:  # the noised step, not a clamped NaN
            weight, bias = reply.content["arrays"].to_numpy_ndarrays()
            assert weight[0, 0] == crafted["weight"][0, 0].item()
            assert (bias != crafted["bias"].numpy()).all()
        transcripts.append(rr.transcript(grid))
    assert transcripts[0] == transcripts[1]
