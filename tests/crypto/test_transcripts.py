"""Red team (issue 38): the client's behaviour does not depend on its secrets.

Two clients that differ in one secret (a label, a LoRA entry, an input feature)
play the same malicious fine-tuning server: it walks the public schedule with
forged ciphertexts and returns, as every updated weight, a ciphertext it crafted
from the client's uploads (an indicator of the label times 10^4, a secret entry
or an input slot minus a threshold doubled to a huge value). Each client then
applies the step and runs the next encrypted inference session. What the server
receives (message kinds and counts, every ciphertext's slots, primes and
polynomials, the meta, aborts and closes) must be the same for both clients.

Exact byte counts are not compared: SEAL compresses each ciphertext, so its size
varies from one fresh encryption to the next (a function of the ciphertext alone,
hence independent of the plaintext under IND-CPA); the structure compared here
fixes the uncompressed size.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tenseal as ts
import torch

from defense_suite.crypto.he.approx import RangeError
from defense_suite.crypto.he.ckks import INTERACTIVE
from defense_suite.crypto.he.evaluator import Value
from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.models.train import predict_logits
from defense_suite.crypto.program.bounds import UpdateBounds, apply_weights
from defense_suite.crypto.program.folding import Arm
from defense_suite.crypto.program.shadow import flag_sequences
from defense_suite.crypto.protocol.client import Client
from defense_suite.crypto.protocol.finetune import encrypted_step
from defense_suite.crypto.protocol.jobs import SGDProgram, TuningJob
from defense_suite.crypto.protocol.server import Server
from defense_suite.crypto.protocol.session import Refused
from defense_suite.crypto.protocol.tuning import TuningServer, tuning_schedule
from defense_suite.crypto.protocol.wire import Channel, Message

Entry = tuple[Any, ...]


class Tap:
    """The server's end of a channel, recording the structure of what arrives."""

    def __init__(self, channel: Channel, log: list[Entry]):
        self.channel, self.log = channel, log
        self.context: Any = None

    def send(self, data: bytes) -> None:
        self.channel.send(data)

    def recv(self) -> bytes:
        data = self.channel.recv()
        self.log.append(shape(data, self))
        return data


def shape(data: bytes, tap: Tap) -> Entry:
    """Kind, meta, and each ciphertext's (slots, primes, polynomials)."""
    message = Message.decode(data)
    if message.kind == "context":
        tap.context = ts.context_from(message.blobs[0])
        return ("context", len(message.blobs))
    blobs = []
    for blob in message.blobs:
        vec = ts.ckks_vector_from(tap.context, blob)
        ct = vec.data.ciphertext()[0]
        blobs.append((vec.size(), ct.coeff_modulus_size(), ct.size()))
    return (message.kind, json.dumps(message.meta, sort_keys=True), tuple(blobs))


def _level(handle: Any, levels: int) -> int:
    return levels + 1 - int(handle.data.ciphertext()[0].coeff_modulus_size())


def _down(handle: Any, level: int, levels: int) -> Any:
    """``handle`` multiplied by 1.0 until it is at least at ``level``."""
    while _level(handle, levels) < level:
        handle = handle * 1.0
    return handle


def _picked(handle: Any, slot: int, slots: int) -> Any:
    """One slot of ``handle``, summed to a replicated value (Galois keys)."""
    mask = [0.0] * slots
    mask[slot] = 1.0
    return (handle * mask).sum()


def _doubled(handle: Any, times: int) -> Any:
    for _ in range(times):
        handle = handle + handle
    return handle


def forged_reply(
    server: TuningServer,
    channel: Channel,
    values: list[Value],
    crafted: Callable[[], Any],
) -> Message:
    """Walk ``server``'s public schedule with forged ciphertexts; reply ``crafted()``.

    Every updated weight of the reply is ``crafted()``, lowered to its level.
    """
    levels = server.params.levels
    schedule = tuning_schedule(server.job, server.params)
    base = values[0].handle
    lifted = {lv: _down(base, lv, levels) for lv in range(levels + 1)}
    for step in schedule.steps:
        forged = [Value(lifted[lv]) for lv in step.levels]
        extra = {"copies": step.copies} if step.kind != "refresh" else {}
        server._ask(channel, step.kind, forged, **extra)
    weight = crafted()
    blobs = tuple(_down(weight, lv, levels).serialize() for lv in schedule.reply.levels)
    return Message("weights", server.key, blobs)


Craft = Callable[[list[Value], int, int], Any]


def label_indicator(k: int = 0, b: int = 0, n: int = 2) -> Craft:
    """10^4 * [label_b == k]: the slot of sequence b in the one-hot target k."""

    def craft(values: list[Value], d: int, slots: int) -> Any:
        return _picked(values[d + k].handle, b * n, slots) * 1e4

    return craft


def amplified_entry(entry: int, threshold: float, times: int = 30) -> Craft:
    """2^times (w - a) for the trained weight entry ``entry`` (folded)."""

    def craft(values: list[Value], d: int, slots: int) -> Any:
        classes = 2
        w = values[d + classes + entry].handle
        return _doubled(w + (-threshold), times)

    return craft


def amplified_input(feature: int, threshold: float, times: int = 30) -> Craft:
    """2^times (z - a) for input feature ``feature`` of token 0 of sequence 0."""

    def craft(values: list[Value], d: int, slots: int) -> Any:
        return _doubled(_picked(values[feature].handle, 0, slots) + (-threshold), times)

    return craft


class Forger(TuningServer):
    """Walks the public schedule with forged ciphertexts, returns crafted weights."""

    craft: Craft = staticmethod(label_indicator())  # type: ignore[assignment]
    log: list[Entry]

    def serve(self, channel: Channel) -> None:
        super().serve(Tap(channel, self.log))

    def _train(
        self, channel: Channel, values: list[Value], meta: dict[str, Any]
    ) -> Message:
        program = self.job.program
        assert isinstance(program, SGDProgram)
        slots = program.slots(self.params)
        craft = type(self).craft
        return forged_reply(
            self, channel, values, lambda: craft(values, program.inputs, slots)
        )


class TappedServer(Server):
    """An honest inference server recording what it receives."""

    log: list[Entry]

    def serve(self, channel: Channel) -> None:
        super().serve(Tap(channel, self.log))


X_STEP = np.random.default_rng(1).random((4, 2, 3))
Y_STEP = np.array([0, 1, 1, 0])


def play(
    model: HEFormer, craft: Craft, X: np.ndarray, y: np.ndarray, X_next: np.ndarray
) -> tuple[list[Entry], dict[str, Any]]:
    """One step against the forger, applied, then one inference session."""
    log: list[Entry] = []

    def make(job: TuningJob, params: Any) -> Forger:
        server = type("F", (Forger,), {"craft": staticmethod(craft)})(job, params)
        server.log = log
        return server

    tuned = copy.deepcopy(model)
    outcome: dict[str, Any] = {}
    try:
        step = encrypted_step(
            tuned, X, y, 0.5, Arm("lora"), server=make, answer_floor=0.0
        )
        outcome["clipped"] = step.clipped
        apply_weights(tuned, step.weights)
    except Exception as err:  # a client-side failure is part of the transcript
        log.append(("raised", type(err).__name__))
        return log, outcome
    outcome["flags"] = flag_sequences(tuned, X_next).tolist()
    try:
        predict_logits(tuned, X_next, guard=True)
        outcome["old guard"] = "passed"
    except RangeError:
        outcome["old guard"] = "refused"
    server = TappedServer.for_model(None, model, INTERACTIVE)
    server.log = log
    client = Client(tuned, INTERACTIVE, answer_floor=0.0)
    try:
        client.predict(server, X_next)
    except Exception as err:
        log.append(("raised", type(err).__name__))
    outcome["finite"] = all(
        bool(np.all(np.isfinite(p.detach().numpy()))) for p in tuned.parameters()
    )
    return log, outcome


def _entry(model: HEFormer, name: str) -> int:
    """Index of ``name``'s first entry among the uploaded trained entries."""
    order = Arm("lora").names
    sizes = {n: np.asarray(w).size for n, w in _weights(model).items()}
    return sum(sizes[n] for n in order[: order.index(name)])


def _weights(model: HEFormer) -> dict[str, np.ndarray]:
    from defense_suite.crypto.program.folding import effective_weights

    return effective_weights(model, Arm("lora"))


def test_label_indicator_attack_transcripts_equal(
    micro_head: HEFormer, micro_inputs: np.ndarray
) -> None:
    """The attack of issue 38: one label's bit through the next session, closed."""
    X_next = micro_inputs[:2]
    y_other = Y_STEP.copy()
    y_other[0] = 1 - y_other[0]
    craft = label_indicator(k=int(Y_STEP[0]), b=0, n=micro_head.config.n_tokens)
    log_a, out_a = play(micro_head, craft, X_STEP, Y_STEP, X_next)
    log_b, out_b = play(micro_head, craft, X_STEP, y_other, X_next)
    # the attack is real: the decrypted update depends on the label ...
    assert out_a["clipped"] != out_b["clipped"]
    # ... and the old guard would have refused for one label only
    assert out_a["old guard"] != out_b["old guard"]
    # but what the server receives is the same, and the model stays finite
    assert log_a == log_b
    assert [e[0] for e in log_a].count("context") == 2  # step, then inference
    assert log_a[-1][0] == "close"
    assert out_a["finite"]
    assert out_b["finite"]


def test_server_stating_other_bounds_transcripts_equal(micro_head: HEFormer) -> None:
    """A forger stating larger update bounds than agreed: refused at its first
    request, before decryption, the same way for either label."""

    class Loose(Forger):
        def statement(self) -> dict[str, Any]:
            return {"bounds": UpdateBounds(entry=1e9, norm=1e9).statement()}

    y_other = Y_STEP.copy()
    y_other[0] = 1 - y_other[0]
    craft = label_indicator(k=int(Y_STEP[0]), b=0, n=micro_head.config.n_tokens)
    logs = []
    for y in (Y_STEP, y_other):
        log: list[Entry] = []

        def make(job: TuningJob, params: Any, log: list[Entry] = log) -> Forger:
            kind = type("L", (Loose,), {"craft": staticmethod(craft)})
            server: Forger = kind(job, params)
            server.log = log
            return server

        with pytest.raises(Refused, match="update bounds"):
            encrypted_step(
                copy.deepcopy(micro_head),
                X_STEP,
                y,
                0.5,
                Arm("lora"),
                server=make,
                answer_floor=0.0,
            )
        logs.append(log)
    assert logs[0] == logs[1]
    assert [e[0] for e in logs[0]] == ["context", "train", "abort"]
    # the agreement the client stated in its train message: its own bounds
    assert json.loads(logs[0][1][1]) == {"bounds": UpdateBounds().statement()}


def _with_entry(model: HEFormer, value: float) -> HEFormer:
    out = copy.deepcopy(model)
    with torch.no_grad():
        out.q.lora_a[0, 0] = value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("secret", ["lora entry", "input feature"])
def test_amplified_secret_transcripts_equal(
    micro_head: HEFormer, micro_inputs: np.ndarray, secret: str
) -> None:
    """Huge server-shaped updates, 2^30 (c - a), for two values of one secret."""
    X_next = micro_inputs[:2]
    if secret == "lora entry":
        pair = [(_with_entry(micro_head, v), X_STEP) for v in (0.3, -0.3)]
        craft = amplified_entry(_entry(micro_head, "q_a"), 0.0)
    else:
        other = X_STEP.copy()
        other[0, 0, :] = 1.0 - other[0, 0, :]
        pair = [(micro_head, X_STEP), (micro_head, other)]
        with torch.no_grad():
            z = [
                float(micro_head.embed_tokens(torch.as_tensor(X))[0, 0, 0])
                for _, X in pair
            ]
        craft = amplified_input(0, 0.5 * (z[0] + z[1]))
    runs = [play(model, craft, X, Y_STEP, X_next) for model, X in pair]
    (log_a, out_a), (log_b, out_b) = runs
    assert out_a["clipped"] > 0
    assert out_b["clipped"] > 0
    assert log_a == log_b
    assert [e[0] for e in log_a].count("context") == 2
    assert out_a["finite"]
    assert out_b["finite"]


def _bert_play(
    he: Any, ids: np.ndarray, mask: np.ndarray, y: np.ndarray, k: int
) -> tuple[list[Entry], dict[str, Any]]:
    """The label-indicator forger against a converted BERT's Q/K/V step, then
    one inference session of the updated model (INTERACTIVE: the forger's
    values need no precision)."""
    from defense_suite.crypto.program.qkv_step import apply_qkv_step
    from defense_suite.crypto.protocol.encoder_client import BertClient
    from defense_suite.crypto.protocol.jobs import QKVJob
    from defense_suite.crypto.protocol.tuning import BertTuningServer
    from defense_suite.crypto.protocol.tuning_client import BertTuningClient

    params, log = INTERACTIVE, []
    w = TuningJob.qkv(he).program.weights  # type: ignore[attr-defined]

    class BertForger(BertTuningServer):
        def serve(self, channel: Channel) -> None:
            super().serve(Tap(channel, log))

        def _train(
            self, channel: Channel, values: list[Value], meta: dict[str, Any]
        ) -> Message:
            # slot 0 (what the client reads) = 10^4 [y_0 = k]; no rotation, so
            # no key-switching noise at this chain's 30-bit special prime
            target = values[w.d + w.n_tokens + k].handle
            return forged_reply(
                self,
                channel,
                values,
                lambda: target * ([1e4] + [0.0] * (target.size() - 1)),
            )

    tuned = copy.deepcopy(he)
    client = BertTuningClient(tuned, params, answer_floor=0.0)
    step = client.step(BertForger(QKVJob.public(he), params), ids, y, 0.5, mask)
    apply_qkv_step(tuned, step)
    outcome = {"clipped": step.clipped, "flags": client_flags(tuned, ids, mask)}
    server = TappedServer.for_model(None, he, params)
    server.log = log
    BertClient(tuned, params, answer_floor=0.0).predict(server, ids, mask=mask)
    return log, outcome


def client_flags(he: Any, ids: np.ndarray, mask: np.ndarray) -> list[bool]:
    from defense_suite.crypto.program.shadow import flag_ids

    return flag_ids(he, ids, mask).tolist()


@pytest.mark.slow
def test_converted_bert_qkv_step_label_indicator(
    converted: Any, tokenizer: object
) -> None:
    """The Q/K/V step of a converted BERT against the label-indicator forger."""
    from tests.crypto.test_qkv_step import LABELS, _batch

    ids, mask = _batch(converted, tokenizer)
    other = LABELS.copy()
    other[0] = 1 - other[0]
    log_a, out_a = _bert_play(converted, ids, mask, LABELS, int(LABELS[0]))
    log_b, out_b = _bert_play(converted, ids, mask, other, int(LABELS[0]))
    assert out_a["clipped"] != out_b["clipped"]  # the decryption is secret-shaped
    assert log_a == log_b
    assert [e[0] for e in log_a].count("context") == 2
