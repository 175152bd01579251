"""The converted BERT's encrypted Q/K/V LoRA step over the bytes-only protocol."""

from __future__ import annotations

import numpy as np
import pytest

from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture

pytest.importorskip("transformers")

from defense_suite.crypto.conversion import HEBert
from defense_suite.crypto.he.ckks import INTERACTIVE, INTERACTIVE_WIDE
from defense_suite.crypto.he.evaluator import Evaluator, NumpyBackend, Value
from defense_suite.crypto.program.bounds import DEFAULT_BOUNDS, UpdateBounds
from defense_suite.crypto.program.encoder import lora_factors
from defense_suite.crypto.program.qkv_step import (
    reference_qkv_step,
    simulated_qkv_step,
    step_inputs,
    updated,
)
from defense_suite.crypto.protocol.jobs import (
    GradientProgram,
    Host,
    QKVJob,
    TuningJob,
    step_slots,
)
from defense_suite.crypto.protocol.schedule import Recorder, safe_bound
from defense_suite.crypto.protocol.server import InProcess
from defense_suite.crypto.protocol.serving import Services
from defense_suite.crypto.protocol.session import Refused
from defense_suite.crypto.protocol.transport import Loopback
from defense_suite.crypto.protocol.tuning import (
    BertTuningServer,
    TuningServer,
    evaluator,
    tuning_schedule,
)
from defense_suite.crypto.protocol.tuning_client import BertTuningClient
from defense_suite.crypto.protocol.wire import Channel, Message, ProtocolError
from tests.crypto.test_qkv_step import LABELS, QKV_STEP_BOUND, _batch, _gap


def _honest_run(
    he: HEBert, ids: np.ndarray, mask: np.ndarray, blocks: int
) -> tuple[Recorder, dict[str, np.ndarray]]:
    """The server's program on the client's real values, float64, recorded."""
    params = INTERACTIVE_WIDE
    job = TuningJob.qkv(he, blocks)
    program = job.program
    assert isinstance(program, GradientProgram)
    slots = step_slots(params, he.config.n_tokens)
    inputs, targets, _, batch = step_inputs(he, ids, mask, LABELS, slots)
    factors = [np.full(slots, x) for M in lora_factors(he).values() for x in M.ravel()]
    rec = Recorder(he.config.n_tokens, safe_bound(params), lambda h: 0)
    services = Services(rec.refresh, rec.roll, rec.unroll)
    ev, services = evaluator(NumpyBackend(), params, services)
    rec.ev = ev
    values = [Value(v) for v in [*inputs, *targets, *factors]]
    flat = program.run(values, {"sequences": batch}, Host(ev, slots, services))
    shapes = {k: (r, c) for k, r, c in program.shapes}
    grads, at = {}, 0
    for name in program.trained:
        r, c = shapes[name]
        grads[name] = np.array([v.handle[0] for v in flat[at : at + r * c]])
        grads[name] = grads[name].reshape(r, c)
        at += r * c
    return rec, grads


@pytest.mark.parametrize("blocks", [1, 2])
def test_schedule_on_zeros_is_what_an_honest_run_requests(
    converted: HEBert, tokenizer: object, blocks: int
) -> None:
    ids, mask = _batch(converted, tokenizer)
    job = TuningJob.qkv(converted, blocks)
    program = job.program
    assert isinstance(program, GradientProgram)
    schedule = tuning_schedule(job, INTERACTIVE_WIDE)
    rec, grads = _honest_run(converted, ids, mask, blocks)
    assert schedule.requests > 0
    assert tuple(rec.steps) == schedule.steps
    kinds = [s.kind for s in schedule.steps]
    assert kinds.count("roll") == 2
    assert kinds.count("unroll") == blocks
    assert len(schedule.reply.levels) == sum(r * c for _, r, c in program.returned)
    assert len(program.trained) == 6 * blocks
    # the message layout carries the same step as the function-call path
    sim = simulated_qkv_step(converted, ids, LABELS, 0.5, mask, blocks=blocks)
    step = updated(converted, grads, 0.5, blocks, 0.0, {})
    assert _gap(step.grads, sim.grads) < 1e-10
    assert _gap(step.factors, sim.factors) < 1e-10


def test_job_and_server_refuse_bad_input(converted: HEBert) -> None:
    with pytest.raises(ValueError, match="trained blocks"):
        TuningJob.qkv(converted, 3)
    with pytest.raises(TypeError, match="TuningJob"):
        BertTuningServer(object(), INTERACTIVE_WIDE)  # type: ignore[arg-type]
    # the former names build the one job and the one server
    former = QKVJob.public(converted, 2)
    assert isinstance(former, TuningJob)
    assert tuning_schedule(former, INTERACTIVE) == tuning_schedule(
        TuningJob.qkv(converted, 2), INTERACTIVE
    )
    assert issubclass(BertTuningServer, TuningServer)
    program = TuningJob.qkv(converted).program
    ev = Evaluator(NumpyBackend(), 10**6, None)
    none = Services(lambda v: v, lambda v, c: [], lambda s: [])
    with pytest.raises(ProtocolError, match="ciphertexts"):
        program.run([], {"sequences": 1}, Host(ev, 12, none))
    zeros = [Value(np.zeros(12)) for _ in range(program.uploads())]
    with pytest.raises(ProtocolError, match="do not fit"):
        program.run(list(zeros), {"sequences": 3}, Host(ev, 12, none))
    with pytest.raises(ProtocolError, match="'sequences' must be an int"):
        program.run(list(zeros), {"sequences": True}, Host(ev, 12, none))


class _Deviant:
    """A malicious server: its first request breaks the schedule.

    It states ``said`` as the update bounds (by default the agreed ones, read
    from the client's ``train`` message) and keeps that message's metadata.
    """

    def __init__(
        self, kind: str, count: int, copies: int, said: object = "agreed"
    ) -> None:
        self.kind, self.count, self.copies = kind, count, copies
        self.said, self.answered = said, ""
        self.train_meta: dict[str, object] = {}

    def serve(self, channel: Channel) -> None:
        while True:
            message = Message.decode(channel.recv())
            if message.kind == "train":
                self.train_meta = dict(message.meta)
                blobs = message.blobs[: self.count]
                said = message.meta["bounds"] if self.said == "agreed" else self.said
                meta = {"copies": self.copies, "bounds": said}
                channel.send(Message(self.kind, message.key, blobs, meta).encode())
                self.answered = Message.decode(channel.recv()).kind
                return


@pytest.mark.parametrize("kind", ["same", "weights"])
def test_client_refuses_a_request_outside_the_schedule(
    converted: HEBert, tokenizer: object, kind: str
) -> None:
    ids, mask = _batch(converted, tokenizer)
    client = BertTuningClient(converted, INTERACTIVE)
    first = client.schedule(TuningJob.qkv(converted)).steps[0]
    # the first request's kind with one ciphertext too many, or an early reply
    extra = first.kind if kind == "same" else kind
    server = _Deviant(extra, len(first.levels) + 1, first.copies)
    connection = InProcess(server)
    with pytest.raises(Refused, match="ciphertexts" if kind == "same" else "weights"):
        client.step(connection, ids, LABELS, 0.5, mask)
    connection.close()
    assert client.decryptions == 0
    assert server.answered == "abort"


def test_agreement_carries_the_clients_bounds(
    converted: HEBert, tokenizer: object
) -> None:
    """The job and the ``train`` message carry the client's own bounds; a first
    request stating other bounds is refused before decryption, and an honest
    server whose job has other bounds refuses the ``train`` message."""
    ids, mask = _batch(converted, tokenizer)
    mine = UpdateBounds(entry=0.125, norm=0.5)
    job = TuningJob.qkv(converted, 1, mine)
    assert job.bounds == mine
    assert TuningJob.qkv(converted).bounds == DEFAULT_BOUNDS
    assert BertTuningServer(job, INTERACTIVE).bounds == mine
    # the bounds are the client's reading of the reply, not the program
    assert tuning_schedule(job, INTERACTIVE) == tuning_schedule(
        TuningJob.qkv(converted), INTERACTIVE
    )
    first = tuning_schedule(job, INTERACTIVE).steps[0]
    client = BertTuningClient(converted, INTERACTIVE, bounds=mine)
    said = DEFAULT_BOUNDS.statement()
    server = _Deviant(first.kind, len(first.levels), first.copies, said)
    connection = InProcess(server)
    with pytest.raises(Refused, match="update bounds"):
        client.step(connection, ids, LABELS, 0.5, mask)
    connection.close()
    assert server.train_meta == {"sequences": 4, "bounds": mine.statement()}
    assert client.decryptions == 0
    assert server.answered == "abort"
    honest = TuningServer(TuningJob.qkv(converted), INTERACTIVE)
    with pytest.raises(ProtocolError, match="stated update bounds"):
        client.step(honest, ids, LABELS, 0.5, mask)
    assert client.decryptions == 0
    with pytest.raises(TypeError, match="UpdateBounds"):
        BertTuningClient(converted, INTERACTIVE, bounds=4.0)  # type: ignore[arg-type]


def test_client_refuses_bad_input(converted: HEBert, tokenizer: object) -> None:
    ids, mask = _batch(converted, tokenizer)
    with pytest.raises(TypeError, match="HEBert"):
        BertTuningClient(object(), INTERACTIVE)  # type: ignore[arg-type]
    client = BertTuningClient(converted, INTERACTIVE)
    server = TuningServer(TuningJob.qkv(converted), INTERACTIVE)
    with pytest.raises(ValueError, match="labels for"):
        client.step(server, ids, LABELS[:3], 0.5, mask)
    assert client.encryptions == 0


@pytest.mark.slow
def test_message_path_step_equals_autograd(
    converted: HEBert, tokenizer: object
) -> None:
    ids, mask = _batch(converted, tokenizer)
    params = INTERACTIVE_WIDE
    ref = reference_qkv_step(converted, ids, LABELS, 0.5, mask)
    job = TuningJob.qkv(converted)
    schedule = tuning_schedule(job, params)
    local = BertTuningClient(converted, params)
    over_inprocess = local.step(TuningServer(job, params), ids, LABELS, 0.5, mask)
    assert over_inprocess.layers == (1,)
    assert _gap(over_inprocess.factors, ref.factors) < QKV_STEP_BOUND
    assert local.counts["round_trips"] == 1 + schedule.requests
    assert local.decryptions > 0
    remote = BertTuningClient(converted, params)
    with Loopback(server=TuningServer(job, params)) as channel:
        over_loopback = remote.step(channel, ids, LABELS, 0.5, mask)
    assert _gap(over_loopback.factors, ref.factors) < QKV_STEP_BOUND
    assert remote.counts["refresh_rounds"] > 0
