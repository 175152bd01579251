"""Red team: an actively malicious HE server against the client's public schedule.

The attacks of issue 26, replayed through the real wire protocol: the reaction
oracle (bisection on a LoRA entry, a head weight, an input slot), requests outside
the schedule, requests in a non-interactive session, forged logits, and a raw
speaker of the wire format that uses none of the package's server code.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import tenseal as ts

from defense_suite.crypto.he.approx import RangeError
from defense_suite.crypto.he.ckks import INTERACTIVE, NON_INTERACTIVE
from defense_suite.crypto.he.evaluator import Value
from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.models.train import predict_logits
from defense_suite.crypto.program.heformer import lora_factors
from defense_suite.crypto.protocol.client import Client, InProcess, Refused, Server
from defense_suite.crypto.protocol.reaction import (
    OracleServer,
    answer_times,
    bisect,
    input_feature,
    lora_entry,
)
from defense_suite.crypto.protocol.schedule import check_batch, safe_bound
from defense_suite.crypto.protocol.wire import MAGIC, Channel, Message

ABORT = Message("abort").encode()


def _would_fail(client: Client, probe: bytes) -> bool:
    """Omniscient: would re-encoding the decrypted probe fail (the old oracle)?"""
    plain = ts.ckks_vector_from(client.context, probe).decrypt()
    try:
        ts.ckks_vector(client.context, plain)
    except ValueError:
        return True
    return False


def test_bisection_on_a_lora_entry_sees_only_answers(
    micro_model: HEFormer, micro_inputs: np.ndarray
) -> None:
    client = Client(micro_model, INTERACTIVE)
    server = OracleServer.for_model(None, micro_model, INTERACTIVE)
    server.target = lora_entry("q_a")
    truth = float(lora_factors(micro_model)["q_a"][0, 0])
    result = bisect(client, server, micro_inputs[:2], -1.0, 1.0, 2)
    # the probes are potent: re-encoding them unclipped fails exactly when c > a
    bits = [_would_fail(client, p) for p in server.probes]
    assert bits == [truth > a for a in server.asked]
    assert any(bits)
    # ... but the client answers every probe (clipped), whatever the secret
    assert result.reactions == (True, True)
    assert result.estimate == -0.75  # the always-answered end, not the secret
    assert client.clipped > 0
    assert server.transcript.inbound[-1][0] == "abort"  # the forged logits


@pytest.mark.slow
@pytest.mark.parametrize("target", ["q_a", "classifier", "input"])
def test_bisection_recovers_nothing(
    micro_head: HEFormer, micro_inputs: np.ndarray, target: str
) -> None:
    """Six sessions per value, as the audit needed; two secrets, one transcript."""
    X = micro_inputs[:2]
    estimates = []
    for flip in (False, True):
        model = micro_head
        if flip:  # a second client whose secret differs in sign
            import copy

            import torch

            model = copy.deepcopy(micro_head)
            with torch.no_grad():
                model.q.lora_a.neg_()
                model.classifier.neg_()
            X = 1.0 - micro_inputs[:2]
        client = Client(model, INTERACTIVE)
        server = OracleServer.for_model(None, model, INTERACTIVE)
        server.target = input_feature(0) if target == "input" else lora_entry(target)
        result = bisect(client, server, X, -4.0, 4.0, 6)
        assert result.reactions == (True,) * 6
        estimates.append(result.estimate)
    assert estimates[0] == estimates[1]


class Replayer(Server):
    """Walks the public schedule with forged ciphertexts, then misbehaves.

    ``mode``: ``extra`` asks one refresh more than the schedule; ``early`` sends
    logits before the last step; ``level`` and ``count`` send logits at a wrong
    level or of a wrong count; ``honest`` sends logits of the agreed shape and
    level (garbage: integrity does not hold).
    """

    mode = "honest"
    decryptions_before_end = -1
    client: Client | None = None
    last = b""

    def _infer(self, channel: Channel, message: Message) -> Message:
        assert self.client is not None
        schedule = self.client.schedule(True)
        inputs = self._load(message)
        steps = schedule.steps[:-1] if self.mode == "early" else schedule.steps
        for step in steps:
            forged = [
                Value(_lift(inputs[i % len(inputs)].handle, lv), lv)
                for i, lv in enumerate(step.levels)
            ]
            meta = {"copies": step.copies} if step.kind != "refresh" else {}
            channel.send(self._dump(step.kind, forged, **meta).encode())
            reply = Message.decode(channel.recv())
            assert reply.kind in ("refreshed", "rolled"), reply.kind
        self.decryptions_before_end = self.client.decryptions
        if self.mode == "extra":
            channel.send(self._dump("refresh", inputs).encode())
            self.last = channel.recv()
        levels = schedule.reply.levels
        if self.mode == "level":
            levels = tuple(lv - 1 for lv in levels)
        count = self.weights.n_classes + (self.mode == "count")
        logits = [
            Value(_lift(inputs[i % len(inputs)].handle, levels[0]))
            for i in range(count)
        ]
        return self._dump("logits", logits)


def _lift(handle: Any, level: int) -> Any:
    for _ in range(level):
        handle = handle * 1.0
    return handle


@pytest.mark.parametrize("mode", ["extra", "early", "level", "count", "honest"])
def test_out_of_schedule_refused_before_decryption(
    micro_model: HEFormer, micro_inputs: np.ndarray, mode: str
) -> None:
    client = Client(micro_model, INTERACTIVE)
    server = Replayer.for_model(None, micro_model, INTERACTIVE)
    server.mode, server.client = mode, client
    schedule = client.schedule(True)
    scheduled = sum(len(s.levels) for s in schedule.steps)
    if mode == "honest":  # agreed shape and level: decrypted, garbage accepted
        logits = client.predict(server, micro_inputs[:2])
        assert logits.shape == (2, micro_model.config.n_classes)
        assert client.decryptions == scheduled + micro_model.config.n_classes
        return
    with pytest.raises(Refused):
        client.predict(server, micro_inputs[:2])
    if mode == "early":
        scheduled -= len(schedule.steps[-1].levels)
    assert server.decryptions_before_end == client.decryptions == scheduled
    if mode == "extra":
        assert server.last == ABORT
    else:
        assert server.transcript.inbound[-1][0] == "abort"


def _frame(kind: str, key: str, blobs: list[bytes], meta: dict[str, Any]) -> bytes:
    """The wire format written by hand (no crypto.protocol.wire code)."""
    header = json.dumps(
        {"kind": kind, "key": key, "sizes": [len(b) for b in blobs], "meta": meta}
    ).encode()
    return b"".join((MAGIC, struct.pack(">I", len(header)), header, *blobs))


def _unframe(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    (size,) = struct.unpack_from(">I", data, len(MAGIC))
    start = len(MAGIC) + 4
    header = json.loads(data[start : start + size])
    at, blobs = start + size, []
    for s in header["sizes"]:
        blobs.append(data[at : at + s])
        at += s
    return header, blobs


class RawSpeaker:
    """A malicious server in raw bytes and TenSEAL: none of the package's code.

    On the ``infer`` message it sends the request ``craft(context, inputs, key)``
    (bytes, or a list of requests sent in turn while the client answers) and
    keeps the client's replies.
    """

    def __init__(self, craft: Any):
        self.craft = craft
        self.replies: list[bytes] = []

    def serve(self, channel: Channel) -> None:
        context = None
        while True:
            header, blobs = _unframe(channel.recv())
            if header["kind"] == "context":
                context = ts.context_from(blobs[0])
            elif header["kind"] == "infer":
                inputs = [ts.ckks_vector_from(context, b) for b in blobs]
                requests = self.craft(context, inputs, header["key"])
                for request in [requests] if isinstance(requests, bytes) else requests:
                    channel.send(request)
                    self.replies.append(channel.recv())
                    if self.replies[-1] == ABORT:
                        return
                return


def _refresh_first(ctx: Any, inputs: list[Any], key: str) -> bytes:
    return _frame("refresh", key, [v.serialize() for v in inputs], {})


def _roll_eight(ctx: Any, inputs: list[Any], key: str) -> bytes:
    """The audit's 'roll of its own input into 8 copies'."""
    return _frame("roll", key, [v.serialize() for v in inputs * 2], {"copies": 8})


def _roll_level0(ctx: Any, inputs: list[Any], key: str) -> bytes:
    """The right roll (2d ciphertexts, n copies) at the wrong level (fresh)."""
    return _frame("roll", key, [v.serialize() for v in inputs * 2], {"copies": 2})


def _roll_garbage(ctx: Any, inputs: list[Any], key: str) -> bytes:
    blobs = [v.serialize() for v in inputs * 2]
    blobs[1] = blobs[1][: len(blobs[1]) // 3]
    return _frame("roll", key, blobs, {"copies": 2})


def _roll_foreign_key(ctx: Any, inputs: list[Any], key: str) -> bytes:
    lifted = [(v * 1.0 * 1.0).serialize() for v in inputs * 2]
    return _frame("roll", "0" * 16, lifted, {"copies": 2})


@pytest.mark.parametrize(
    "craft",
    [_refresh_first, _roll_eight, _roll_level0, _roll_garbage, _roll_foreign_key],
)
def test_raw_wire_speaker_gets_one_empty_abort(
    micro_model: HEFormer, micro_inputs: np.ndarray, craft: Any
) -> None:
    client = Client(micro_model, INTERACTIVE)
    speaker = RawSpeaker(craft)
    connection = InProcess(speaker)
    try:
        with pytest.raises(Refused):
            client.predict(connection, micro_inputs[:2])
    finally:
        connection.close()
    assert client.decryptions == 0
    assert speaker.replies == [ABORT]  # the same bytes whatever was asked


def test_raw_wire_speaker_forged_roll_is_answered(
    micro_model: HEFormer, micro_inputs: np.ndarray
) -> None:
    """Control: the same speaker, following the schedule, is answered."""

    def roll(ctx: Any, inputs: list[Any], key: str) -> bytes:
        lifted = [(v * 1.0 * 1.0).serialize() for v in inputs * 2]
        return _frame("roll", key, lifted, {"copies": 2})

    client = Client(micro_model, INTERACTIVE)
    speaker = RawSpeaker(roll)
    connection = InProcess(speaker)
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            client.predict(connection, micro_inputs[:2])
    finally:
        connection.close()
    header, blobs = _unframe(speaker.replies[0])
    assert header["kind"] == "rolled"
    assert len(blobs) == 8
    assert client.decryptions == 4


@pytest.mark.slow
def test_non_interactive_session_answers_nothing(
    micro_model: HEFormer, micro_inputs: np.ndarray
) -> None:
    client = Client(micro_model, NON_INTERACTIVE)
    assert client.schedule(False).steps == ()

    def refresh(ctx: Any, inputs: list[Any], key: str) -> bytes:
        return _frame("refresh", key, [inputs[0].serialize()], {})

    speaker = RawSpeaker(refresh)
    connection = InProcess(speaker)
    try:
        with pytest.raises(Refused, match="beyond the public schedule of 0"):
            client.predict(connection, micro_inputs[:2], interactive=False)
    finally:
        connection.close()
    assert client.decryptions == 0
    assert speaker.replies == [ABORT]


def test_honest_run_is_unchanged_by_the_clip(
    micro_model: HEFormer, micro_inputs: np.ndarray
) -> None:
    calibrated = Client(micro_model, INTERACTIVE, calibration=micro_inputs)
    plain = Client(micro_model, INTERACTIVE)
    X = micro_inputs[:4]
    got = calibrated.predict(Server.for_model(None, micro_model, INTERACTIVE), X)
    ref = plain.predict(Server.for_model(None, micro_model, INTERACTIVE), X)
    assert calibrated.clipped == plain.clipped == 0
    want = predict_logits(micro_model, X)
    assert np.max(np.abs(got - want)) < 1e-2
    assert np.max(np.abs(got - ref)) < 1e-2
    steps = calibrated.schedule(True).steps
    assert all(b < safe_bound(INTERACTIVE) for s in steps for b in s.bounds)
    assert calibrated.exchanges[-1].round_trips == 1 + len(steps)


def test_calibrated_client_refuses_a_batch_it_would_clip(
    micro_model: HEFormer, micro_inputs: np.ndarray
) -> None:
    client = Client(micro_model, INTERACTIVE, calibration=micro_inputs)
    schedule = client.schedule(True)
    check_batch(schedule, micro_model, micro_inputs[:4])
    tight = replace(
        schedule,
        steps=tuple(replace(s, bounds=(1e-6,) * len(s.bounds)) for s in schedule.steps),
    )
    with pytest.raises(RangeError, match="calibrated range of the 'roll K and V'"):
        check_batch(tight, micro_model, micro_inputs[:4])


@pytest.mark.slow
def test_answer_time_small_versus_huge(micro_model: HEFormer) -> None:
    """The timing channel, measured: reported in docs/crypto.md."""
    client = Client(micro_model, INTERACTIVE, answer_floor=0.0)  # unpadded
    times = answer_times(client, repeats=40)
    print(times)
    assert times["small"] > 0
    assert times["huge"] > 0
    assert client.clipped > 0  # the huge plaintexts were clipped, and answered
    # padded to a public floor above the answer's own time: the gap closes
    floor = 2.0 * times["huge"] / 4
    padded = Client(micro_model, INTERACTIVE, answer_floor=floor)
    even = answer_times(padded, repeats=15)
    print("padded", even)
    assert min(even["small"], even["huge"]) >= 4 * floor
    assert abs(even["difference"]) < 0.03 * even["small"]


def test_answer_floor_pads_and_is_checked(micro_model: HEFormer) -> None:
    import time

    with pytest.raises(ValueError, match="answer_floor"):
        Client(micro_model, INTERACTIVE, answer_floor=-1.0)
    client = Client(micro_model, INTERACTIVE, answer_floor=0.2)
    slots = client.schedule(True).reply.sizes[0]
    public = ts.context_from(client.public_context())
    c = ts.ckks_vector(public, [0.5] * slots)
    step = replace(
        client.schedule(True).steps[1], levels=(0,), sizes=(slots,), bounds=(1.0,)
    )
    start = time.perf_counter()
    reply = client.answer(Message("refresh", client.key, (c.serialize(),)), step)
    assert time.perf_counter() - start >= 0.2
    assert reply.kind == "refreshed"


def test_raw_wire_speaker_bisection_on_an_input_slot(
    micro_model: HEFormer, micro_inputs: np.ndarray
) -> None:
    """The bisection in raw bytes: a forged roll, then probes in the refresh."""
    client = Client(micro_model, INTERACTIVE)
    second = client.schedule(True).steps[1]  # public: the levels of the refresh
    slots = second.sizes[0]
    reactions, lo, hi = [], -4.0, 4.0
    probes: list[bytes] = []
    for _ in range(3):
        a, w = (lo + hi) / 2, (hi - lo) / 2

        def craft(
            ctx: Any, inputs: list[Any], key: str, a: float = a, w: float = w
        ) -> list[bytes]:
            from defense_suite.crypto.protocol.reaction import encoding_limit

            limit = encoding_limit(ctx, slots)
            p = inputs[0] + (-a)
            for _ in range(int(np.floor(np.log2(limit / 4 / w)))):
                p = p + p
            probe = ts.ckks_vector(ctx, [limit * (1 - 2.0**-10)] * slots) + p
            lifted = [v * 1.0 * 1.0 for v in inputs]
            roll = _frame(
                "roll", key, [v.serialize() for v in lifted * 2], {"copies": 2}
            )
            probes.append(probe.serialize())
            blobs = [
                probe.serialize() if lv == 0 else lifted[i % 2].serialize()
                for i, lv in enumerate(second.levels)
            ]
            return [roll, _frame("refresh", key, blobs, {})]

        speaker = RawSpeaker(craft)
        connection = InProcess(speaker)
        try:
            with pytest.raises((Refused, RuntimeError)):
                client.predict(connection, micro_inputs[:2])
        finally:
            connection.close()
        answered = _unframe(speaker.replies[-1])[0]["kind"] == "refreshed"
        reactions.append(answered)
        lo, hi = (lo, a) if answered else (a, hi)
    assert reactions == [True, True, True]
    assert client.clipped > 0
    # the oracle is real: unclipped, some of these probes would have failed
    assert any(_would_fail(client, p) for p in probes)
