"""Encrypted inference of a converted ``transformers`` BERT: program and protocol."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from torch import nn

from tests.crypto.tiny_bert import N_TOKENS, texts
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture

transformers = pytest.importorskip("transformers")

from defense_suite.crypto.conversion import HEBert, convert  # noqa: E402
from defense_suite.crypto.conversion.tokenizer import encode  # noqa: E402
from defense_suite.crypto.he.approx import RangeError  # noqa: E402
from defense_suite.crypto.he.ckks import (  # noqa: E402
    INTERACTIVE,
    INTERACTIVE_WIDE,
    CKKSParams,
)
from defense_suite.crypto.he.evaluator import DepthError  # noqa: E402
from defense_suite.crypto.program.encoder import BertWeights  # noqa: E402
from defense_suite.crypto.program.head_step import (  # noqa: E402
    encrypted_head_step,
    reference_head_step,
    simulated_head_step,
)
from defense_suite.crypto.program.inputs import simulate  # noqa: E402
from defense_suite.crypto.protocol.client import InProcess, Refused, Server  # noqa: E402
from defense_suite.crypto.protocol.encoder_client import (  # noqa: E402
    BertClient,
    inference_schedule,
)
from defense_suite.crypto.protocol.transport import Loopback  # noqa: E402
from defense_suite.crypto.protocol.wire import Channel, Message  # noqa: E402

ERROR_BOUND = 5e-3
"""Largest |encrypted - plaintext| logit accepted on INTERACTIVE (N 8192, 2^30)."""


def test_he_program_equals_the_plaintext_model(
    converted: HEBert, tokenizer: object
) -> None:
    ids, mask = encode(tokenizer, texts(), converted)
    assert (mask == 0).any(), "the texts must exercise the padding mask"
    plain = converted.predict_logits(ids, mask)
    simulated, counts = simulate(converted, ids, mask)
    assert np.max(np.abs(simulated - plain)) < 1e-9
    assert counts["roll_rounds"] == 2  # one per block
    # on a 5-level chain the program asks for refreshes; the result is unchanged
    chained, counts = simulate(converted, ids, mask, max_level=INTERACTIVE.levels)
    assert np.max(np.abs(chained - plain)) < 1e-9
    schedule = inference_schedule(converted, INTERACTIVE, INTERACTIVE.slots)
    kinds = [s.kind for s in schedule.steps]
    assert kinds.count("refresh") == counts["refresh_rounds"] > 0
    assert kinds.count("roll") == 2
    assert len(schedule.reply.levels) == converted.config.n_classes
    # CKKS-like noise moves the logits by about the noise, not more
    noisy, _ = simulate(
        converted, ids, mask, INTERACTIVE.levels, 1e-6, np.random.default_rng(0)
    )
    assert 0 < np.max(np.abs(noisy - plain)) < 1e-3


def test_refusals(converted: HEBert, tokenizer: object) -> None:
    ids, mask = encode(tokenizer, texts()[:3], converted)
    client = BertClient(converted, INTERACTIVE)
    with pytest.raises(ValueError, match="interactively only"):
        client.schedule(False)
    with pytest.raises(ValueError, match="shape"):
        client.encrypt_inputs(ids[:, :3])
    narrow = copy.deepcopy(converted)
    narrow.calibrate(ids[:1], mask[:1], margin=1.01)
    with pytest.raises(RangeError, match="calibrated ranges"):
        BertClient(narrow, INTERACTIVE).encrypt_inputs(ids[1:], mask=mask[1:])
    short = CKKSParams(8192, (38, 30, 30, 30, 30, 30), 30)
    with pytest.raises(DepthError, match="needs 5 levels"):
        inference_schedule(converted, short, 8)
    with pytest.raises(TypeError, match="HEBert"):
        BertWeights.from_model(nn.Linear(2, 2))
    raw, _ = convert(_teacher_like(converted), n_tokens=N_TOKENS)
    with pytest.raises(ValueError, match="calibrate"):
        BertClient(raw, INTERACTIVE)


def _teacher_like(he: HEBert) -> nn.Module:
    c = he.config
    config = transformers.BertConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.heads,
        intermediate_size=c.ffn,
        max_position_embeddings=8,
        num_labels=c.n_classes,
    )
    model: nn.Module = transformers.BertForSequenceClassification(config).eval()
    return model


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["in-process", "loopback"])
def test_encrypted_inference_matches_the_converted_model(
    converted: HEBert, tokenizer: object, transport: str
) -> None:
    sentences = [*texts()[:3], "good film"]
    ids, mask = encode(tokenizer, sentences, converted)
    plain = converted.predict_logits(ids, mask)
    client = BertClient(converted, INTERACTIVE)
    if transport == "in-process":
        server = Server.for_model(None, converted, INTERACTIVE)
        encrypted = client.predict_texts(server, tokenizer, sentences)
        assert server.counts["roll_rounds"] == 2
    else:
        with Loopback.for_model(converted, INTERACTIVE) as connection:
            encrypted = client.predict(connection, ids, mask=mask)
    assert np.array_equal(encrypted.argmax(1), plain.argmax(1))
    assert np.max(np.abs(encrypted - plain)) < ERROR_BOUND
    exchange = client.exchanges[-1]
    steps = client.schedule().requests
    assert exchange.round_trips == 1 + steps
    assert client.clipped == 0


def _adapter(he: HEBert) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    c = he.config
    return 0.3 * rng.normal(size=(c.d, 2)), 0.3 * rng.normal(size=(2, c.n_classes))


@pytest.fixture(scope="module")
def head_case(converted: HEBert, tokenizer: object) -> tuple[Any, ...]:
    """(ids, mask, labels, A, B, the autograd step) of the classifier-adapter tests."""
    ids, mask = encode(tokenizer, texts()[-4:], converted)
    y = np.array([1, 0, 1, 0])
    A, B = _adapter(converted)
    return ids, mask, y, A, B, reference_head_step(converted, ids, y, A, B, 0.5, mask)


def test_head_lora_step_program_equals_autograd(
    converted: HEBert, head_case: tuple[Any, ...]
) -> None:
    ids, mask, y, A, B, ref = head_case
    assert np.max(np.abs(ref.grad_a)) > 1e-3  # a real step, not a zero one
    sim = simulated_head_step(converted, ids, y, A, B, 0.5, mask, max_level=5)
    assert np.max(np.abs(sim.grad_a - ref.grad_a)) < 1e-9
    assert np.max(np.abs(sim.b - ref.b)) < 1e-9
    assert sim.counts["refresh_rounds"] > 0
    assert sim.counts["slot_sums"] == 2 * (
        converted.config.d + converted.config.n_classes
    )
    with pytest.raises(ValueError, match="labels for"):
        simulated_head_step(converted, ids, y[:3], A, B, 0.5, mask)
    with pytest.raises(ValueError, match="expected shapes"):
        simulated_head_step(converted, ids, y, A.T, B, 0.5, mask)
    with pytest.raises(ValueError, match="labels must lie"):
        simulated_head_step(converted, ids, y + 5, A, B, 0.5, mask)


STEP_BOUND = 1e-3
"""Largest |encrypted - autograd| adapter entry accepted on INTERACTIVE_WIDE."""


@pytest.mark.slow
def test_encrypted_head_lora_step_equals_the_plaintext_step(
    converted: HEBert, head_case: tuple[Any, ...]
) -> None:
    ids, mask, y, A, B, ref = head_case
    enc = encrypted_head_step(converted, ids, y, A, B, 0.5, INTERACTIVE_WIDE, mask)
    assert np.max(np.abs(enc.a - ref.a)) < STEP_BOUND
    assert np.max(np.abs(enc.b - ref.b)) < STEP_BOUND


def test_byo_encrypted_rows_are_off_by_default(converted: HEBert) -> None:
    from defense_suite.crypto.benchmark.byo_he import encrypted_rows

    ids = np.zeros((2, N_TOKENS), dtype=np.int64)
    settings = {"encrypted": 0, "lora_step": 0}
    assert encrypted_rows(converted, ids, ids + 1, np.zeros(2), settings, 0, {}) == []


@pytest.mark.slow
def test_byo_encrypted_row_measures_agreement_and_traffic(
    converted: HEBert, tokenizer: object
) -> None:
    from defense_suite.crypto.benchmark.byo_he import encrypted_rows

    ids, mask = encode(tokenizer, texts()[:3], converted)
    y = converted.predict_logits(ids, mask).argmax(1)
    settings = {"encrypted": 3, "lora_step": 0}
    [row] = encrypted_rows(converted, ids, mask, y, settings, 0, {})
    assert row.defense == "encrypted"
    assert row.utility["agreement"] == 1.0
    assert row.utility["accuracy"] == 1.0  # the labels are the plaintext argmax
    assert row.utility["max_abs_error"] < ERROR_BOUND
    assert row.cost["mb_per_seq"] > 0
    schedule = inference_schedule(converted, INTERACTIVE, INTERACTIVE.slots)
    assert row.cost["round_trips"] == 1 + schedule.requests


class _EarlyRoller:
    """A malicious server: asks to roll the client's fresh inputs (level 0)."""

    def serve(self, channel: Channel) -> None:
        while True:
            message = Message.decode(channel.recv())
            if message.kind == "infer":
                blobs = (message.blobs * 2)[: 2 * converted_width(message)]
                channel.send(
                    Message("roll", message.key, blobs, {"copies": N_TOKENS}).encode()
                )
                channel.recv()  # the client's abort
                return


def converted_width(message: Message) -> int:
    return len(message.blobs) - N_TOKENS  # d input values, then n key weights


def test_client_refuses_a_request_outside_the_schedule(
    converted: HEBert, tokenizer: object
) -> None:
    ids, mask = encode(tokenizer, texts()[:2], converted)
    client = BertClient(converted, INTERACTIVE)
    with pytest.raises(Refused, match="primes"):
        client.predict(InProcess(_EarlyRoller()), ids, mask=mask)
    assert client.decryptions == 0
