"""Encrypted fine-tuning as messages: same answers, same schedule rules as inference."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from defense_suite.crypto.he.evaluator import Value
from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.program.bounds import DEFAULT_BOUNDS, UpdateBounds
from defense_suite.crypto.program.folding import Arm
from defense_suite.crypto.program.steps import TRAIN_PARAMS, _prepare, simulated_step
from defense_suite.crypto.protocol import tuning
from defense_suite.crypto.protocol.finetune import encrypted_step
from defense_suite.crypto.protocol.jobs import SGDProgram, TuningJob
from defense_suite.crypto.protocol.server import InProcess
from defense_suite.crypto.protocol.session import Refused
from defense_suite.crypto.protocol.tuning import TuningServer, tuning_schedule
from defense_suite.crypto.protocol.tuning_client import TuningClient
from defense_suite.crypto.protocol.wire import Channel, Message, ProtocolError

ABORT = Message("abort").encode()


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.random((4, 2, 3)), np.array([0, 1, 1, 0])


def test_schedule_follows_the_program(micro_model: HEFormer) -> None:
    X, y = _batch()
    net, fold, _, _, b = _prepare(micro_model, X, y, Arm("lora"))
    one = tuning_schedule(TuningJob.sgd(net, fold, 0.5, 1, b), TRAIN_PARAMS)
    two = tuning_schedule(TuningJob.sgd(net, fold, 0.5, 2, b), TRAIN_PARAMS)
    kinds = [s.kind for s in one.steps]
    assert kinds[0] == "roll"
    assert kinds.count("unroll") == 1
    # the second step: one refresh of every trained weight, then the same program
    assert two.requests == 2 * one.requests + 1
    assert two.steps[one.requests].stage == "weights refresh"
    assert len(two.steps[one.requests].levels) == len(one.reply.levels)
    # no trained value leaks into the public job
    job = TuningJob.sgd(net, fold, 0.5, 1, b)
    assert isinstance(job.program, SGDProgram)
    assert all(not np.asarray(job.program.net.mats[n]).any() for n in net.trained)
    assert any(np.asarray(net.mats[n]).any() for n in net.trained)


@pytest.mark.slow
def test_loopback_step_equals_in_process_and_function_calls(
    micro_model: HEFormer,
) -> None:
    X, y = _batch()
    arm = Arm("lora")
    local = encrypted_step(micro_model, X, y, 0.5, arm)
    remote = encrypted_step(micro_model, X, y, 0.5, arm, transport="loopback")
    calls = simulated_step(micro_model, X, y, 0.5, arm)
    for name in arm.names:
        assert np.max(np.abs(remote.weights[name] - local.weights[name])) < 1e-5
        assert np.max(np.abs(local.weights[name] - calls.weights[name])) < 1e-5
    assert local.counts["round_trips"] == remote.counts["round_trips"]
    shared = set(calls.counts) & set(local.counts)
    assert {k: calls.counts[k] for k in shared} == {k: local.counts[k] for k in shared}


class MaliciousTuner(TuningServer):
    """Asks out of schedule (``first``) or probes a secret weight (``probe``)."""

    mode = "first"
    threshold = 0.0
    reply = b""

    def _train(
        self, channel: Channel, values: list[Value], meta: dict[str, Any]
    ) -> Message:
        program = self.job.program
        assert isinstance(program, SGDProgram)
        d, classes = program.inputs, 2
        weights = values[d + classes :]
        if self.mode == "first":  # a refresh of the secret weights, at once
            request = [v.handle for v in weights]
            extra: dict[str, Any] = {}
            kind = "refresh"
        else:  # the scheduled roll (2d ciphertexts, level 2), every one a probe
            p = weights[0].handle + (-self.threshold)
            for _ in range(100):
                p = p + p
            request = [p * 1.0 * 1.0] * (2 * d)
            extra, kind = {"copies": program.n_tokens}, "roll"
        blobs = tuple(h.serialize() for h in request)
        # the agreed bounds stated, as a server that wants an answer does
        channel.send(self._stated(Message(kind, self.key, blobs, extra)).encode())
        self.reply = channel.recv()
        return Message("weights", self.key, blobs[:1])


def _session(
    model: HEFormer, mode: str, threshold: float, client: TuningClient | None = None
) -> tuple[TuningClient, bytes]:
    X, y = _batch()
    net, fold, packed, onehot, b = _prepare(model, X, y, Arm("lora"))
    job = TuningJob.sgd(net, fold, 0.5, 1, b)
    server = MaliciousTuner(job, TRAIN_PARAMS)
    server.mode, server.threshold = mode, threshold
    client = client or TuningClient(TRAIN_PARAMS, model.config.n_tokens)
    secret = {n: np.asarray(net.mats[n]) for n in net.trained}
    connection = InProcess(server)
    try:
        with pytest.raises(Refused):
            client.train(connection, job, secret, packed, onehot)
    finally:
        connection.close()
    return client, server.reply


def test_tuning_server_out_of_schedule_gets_an_empty_abort(
    micro_model: HEFormer,
) -> None:
    client, reply = _session(micro_model, "first", 0.0)
    assert reply == ABORT
    assert client.decryptions == 0


def test_tuning_reaction_oracle_sees_only_answers(micro_model: HEFormer) -> None:
    """Probes on both sides of the secret weight: answered alike (no reaction)."""
    kinds, client = [], None
    for threshold in (-10.0, 10.0):
        client, reply = _session(micro_model, "probe", threshold, client)
        kinds.append(Message.decode(reply).kind)
    assert kinds == ["rolled", "rolled"]
    assert client is not None
    assert client.decryptions == 2 * 2 * micro_model.config.d


def test_tuning_weights_reply_checked_before_decryption(
    micro_model: HEFormer,
) -> None:
    class EarlyWeights(TuningServer):
        def _train(
            self, channel: Channel, values: list[Value], meta: dict[str, Any]
        ) -> Message:
            return Message(
                "weights", self.key, tuple(v.handle.serialize() for v in values[:3])
            )

    X, y = _batch()
    net, fold, packed, onehot, b = _prepare(micro_model, X, y, Arm("lora"))
    job = TuningJob.sgd(net, fold, 0.5, 1, b)
    client = TuningClient(TRAIN_PARAMS, micro_model.config.n_tokens)
    secret = {n: np.asarray(net.mats[n]) for n in net.trained}
    connection = InProcess(EarlyWeights(job, TRAIN_PARAMS))
    try:
        with pytest.raises(Refused, match="expected a 'roll'"):
            client.train(connection, job, secret, packed, onehot)
    finally:
        connection.close()
    assert client.decryptions == 0


def test_refresh_requests_are_chunked_alike_on_both_sides(
    micro_model: HEFormer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refresh beyond REFRESH_VALUES goes in several requests, each scheduled."""
    X, y = _batch()
    arm = Arm("lora")
    net, fold, _, _, b = _prepare(micro_model, X, y, arm)
    job = TuningJob.sgd(net, fold, 0.5, 2, b)
    whole = tuning_schedule(job, TRAIN_PARAMS)
    monkeypatch.setattr(tuning, "REFRESH_VALUES", 3)
    parts = tuning_schedule(job, TRAIN_PARAMS)
    assert parts.requests > whole.requests
    for kind in ("refresh", "roll", "unroll"):
        levels = [lv for s in whole.steps if s.kind == kind for lv in s.levels]
        assert [lv for s in parts.steps if s.kind == kind for lv in s.levels] == levels
    assert all(len(s.levels) <= 3 for s in parts.steps if s.kind == "refresh")
    step = encrypted_step(micro_model, X, y, 0.5, arm, steps=2)
    want = simulated_step(micro_model, X, y, 0.5, arm, steps=2)
    for name in arm.names:
        assert np.max(np.abs(step.weights[name] - want.weights[name])) < 1e-5
    assert step.counts["round_trips"] == parts.requests + 1


# --- the update bounds are part of the agreement (issue 38, item 2) ---------------

OTHER = UpdateBounds(entry=1e6, norm=1e6)


class Recording:
    """A channel that records what the client sends and never answers."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def recv(self) -> bytes:
        raise AssertionError("the client must not wait for an answer")


def test_the_job_carries_the_clients_bounds(micro_model: HEFormer) -> None:
    """The job states the bounds; a job with other bounds is refused before sending."""
    X, y = _batch()
    net, fold, packed, onehot, b = _prepare(micro_model, X, y, Arm("lora"))
    mine = UpdateBounds(entry=0.25, norm=0.5)
    job = TuningJob.sgd(net, fold, 0.5, 1, b, mine)
    assert job.bounds == mine
    assert TuningJob.sgd(net, fold, 0.5, 1, b).bounds == DEFAULT_BOUNDS
    # the former name builds the same job
    assert tuning_schedule(TuningJob.public(net, fold, 0.5, 1, b), TRAIN_PARAMS) == (
        tuning_schedule(job, TRAIN_PARAMS)
    )
    assert TuningServer(job, TRAIN_PARAMS).bounds == mine
    # the bounds change what the client does with the reply, not the program
    assert tuning_schedule(job, TRAIN_PARAMS) == tuning_schedule(
        replace(job, bounds=OTHER), TRAIN_PARAMS
    )
    client = TuningClient(TRAIN_PARAMS, micro_model.config.n_tokens, bounds=mine)
    secret = {n: np.asarray(net.mats[n]) for n in net.trained}
    channel = Recording()
    with pytest.raises(ValueError, match="update bounds"):
        client.train(channel, replace(job, bounds=OTHER), secret, packed, onehot)
    assert channel.sent == []
    assert client.encryptions == 0
    with pytest.raises(TypeError, match="UpdateBounds"):
        TuningClient(TRAIN_PARAMS, 2, bounds=(1.0, 4.0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="UpdateBounds"):
        TuningServer(replace(job, bounds=None), TRAIN_PARAMS)  # type: ignore[arg-type]


def test_a_key_owners_public_context_is_sent_as_serialized_once(
    micro_model: HEFormer,
) -> None:
    """A client given its KeyOwner's serialized public context sends those bytes
    (equal to serializing again); given without its context, or not as bytes, it
    is refused."""
    from defense_suite.crypto.he.ckks import public_bytes
    from defense_suite.crypto.protocol.finetune import KeyOwner

    X, y = _batch()
    net, fold, packed, onehot, b = _prepare(micro_model, X, y, Arm("lora"))
    job = TuningJob.sgd(net, fold, 0.5, 1, b)
    n = micro_model.config.n_tokens
    owner = KeyOwner(TRAIN_PARAMS, n)
    assert owner.public_blob == public_bytes(owner.context)
    client = TuningClient(
        TRAIN_PARAMS, n, owner.context, 0.0, public_context=owner.public_blob
    )
    channel = Recording()
    secret = {k: np.asarray(net.mats[k]) for k in net.trained}
    with pytest.raises(AssertionError, match="must not wait"):
        client.train(channel, job, secret, packed, onehot)
    sent = Message.decode(channel.sent[0])
    assert (sent.kind, sent.blobs) == ("context", (owner.public_blob,))
    with pytest.raises(ValueError, match="public_context: give it with the context"):
        TuningClient(TRAIN_PARAMS, n, public_context=owner.public_blob)
    with pytest.raises(TypeError, match="public_context must be bytes"):
        TuningClient(TRAIN_PARAMS, n, owner.context, public_context="x")  # type: ignore[arg-type]


class Misstating(TuningServer):
    """Accepts the client's bounds but states ``said`` in its messages of ``kinds``."""

    said: dict[str, Any]
    kinds: tuple[str, ...] = ("roll", "refresh", "unroll", "weights")
    answered: list[str]

    def _stated(self, message: Message) -> Message:
        honest = super()._stated(message)
        if message.kind not in self.kinds:
            return honest
        meta = {k: v for k, v in honest.meta.items() if k != "bounds"}
        return Message(message.kind, message.key, message.blobs, {**meta, **self.said})

    def _ask(
        self, channel: Channel, kind: str, values: list[Value], **meta: Any
    ) -> list[Value]:
        try:
            return super()._ask(channel, kind, values, **meta)
        finally:
            self.answered.append(self.inbound[-1])


@pytest.mark.parametrize(
    "said",
    [{"bounds": OTHER.statement()}, {}],
    ids=["larger", "none"],  # malformed statements: test_client_rules
)
def test_server_stating_other_bounds_is_refused_before_decryption(
    micro_model: HEFormer, said: dict[str, Any]
) -> None:
    """Its first request states other bounds: one empty abort, nothing decrypted."""
    X, y = _batch()

    def make(job: TuningJob, params: Any) -> Misstating:
        server = Misstating(job, params)
        server.said, server.answered = said, []
        made.append(server)
        return server

    made: list[Misstating] = []
    with pytest.raises(Refused, match="update bounds"):
        encrypted_step(
            micro_model, X, y, 0.5, Arm("lora"), server=make, answer_floor=0.0
        )
    assert made[0].answered == ["abort"]
    assert made[0].inbound == ["context", "train", "abort"]


def test_other_bounds_in_the_reply_only_are_refused_before_its_decryption(
    micro_model: HEFormer,
) -> None:
    """Honest requests, the reply states other bounds: the reply is not decrypted."""
    X, y = _batch()
    net, fold, packed, onehot, b = _prepare(micro_model, X, y, Arm("lora"))
    job = TuningJob.sgd(net, fold, 0.5, 1, b)
    server = Misstating(job, TRAIN_PARAMS)
    server.said, server.kinds, server.answered = {}, ("weights",), []
    client = TuningClient(TRAIN_PARAMS, micro_model.config.n_tokens, answer_floor=0.0)
    secret = {n: np.asarray(net.mats[n]) for n in net.trained}
    schedule = tuning_schedule(job, TRAIN_PARAMS)
    connection = InProcess(server)
    try:
        with pytest.raises(Refused, match="updated weights: the server states"):
            client.train(connection, job, secret, packed, onehot)
    finally:
        connection.close()
    asked = sum(len(s.levels) for s in schedule.steps)
    assert client.decryptions == asked  # the requests' only, not the reply's
    assert server.inbound[-1] == "abort"


def test_honest_server_refuses_a_train_stating_other_bounds(
    micro_model: HEFormer,
) -> None:
    """Both sides hold the agreement: an honest server with another job says so."""
    X, y = _batch()

    def make(job: TuningJob, params: Any) -> TuningServer:
        return TuningServer(replace(job, bounds=OTHER), params)

    with pytest.raises(ProtocolError, match="stated update bounds"):
        encrypted_step(micro_model, X, y, 0.5, Arm("lora"), server=make, answer_floor=0)


def test_honest_step_under_agreed_bounds_is_unchanged(micro_model: HEFormer) -> None:
    """Client and server agree on other bounds: the step is the function-call one."""
    X, y = _batch()
    arm = Arm("lora")
    mine = UpdateBounds(entry=0.5, norm=2.0)
    seen: list[dict[str, Any]] = []

    class Watching(TuningServer):
        def _train(
            self, channel: Channel, values: list[Value], meta: dict[str, Any]
        ) -> Message:
            seen.append(dict(meta))
            return super()._train(channel, values, meta)

    step = encrypted_step(
        micro_model, X, y, 0.5, arm, bounds=mine, server=Watching, answer_floor=0.0
    )
    want = simulated_step(micro_model, X, y, 0.5, arm)
    assert seen == [{"bounds": {"entry": 0.5, "norm": 2.0}}]
    assert step.bounds == mine
    assert step.clipped == 0
    for name in arm.names:
        assert np.max(np.abs(step.weights[name] - want.weights[name])) < 1e-5


def test_one_client_refuses_an_upload_off_the_jobs_layout(
    micro_model: HEFormer,
) -> None:
    """The one key owner checks its upload against the public job before sending:
    a secret matrix of another shape or a missing input ciphertext is refused
    (ValueError), nothing encrypted, nothing sent."""
    X, y = _batch()
    net, fold, packed, onehot, b = _prepare(micro_model, X, y, Arm("lora"))
    job = TuningJob.sgd(net, fold, 0.5, 1, b)
    secret = {n: np.asarray(net.mats[n]) for n in net.trained}
    client = TuningClient(TRAIN_PARAMS, micro_model.config.n_tokens, answer_floor=0.0)
    wrong = dict(secret, q_a=secret["q_a"][:, :1])
    for mine, inputs in ((wrong, packed), (secret, packed[:-1])):
        channel = Recording()
        with pytest.raises(ValueError, match="the job"):
            client.train(channel, job, mine, inputs, onehot)
        assert channel.sent == []
    assert client.encryptions == 0
