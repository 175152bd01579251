"""The bad-input rule (issue 19) on the HE package's public entry points."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from defense_suite.crypto.he.ckks import (
    INTERACTIVE,
    CKKSParams,
    load_ciphertext,
    load_public,
)
from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.models.train import predict_logits
from defense_suite.crypto.program.heformer import simulate
from defense_suite.crypto.program.steps import simulated_step
from defense_suite.crypto.protocol.client import Client, Server
from defense_suite.crypto.protocol.wire import Message
from defense_suite.crypto.tasks import Sequences
from defenses.testing import assert_rule, bad_arrays, bad_reals, rule_settings

X_NAMES = ("x:", "x has", "x is", "x must", "x leaves")


@pytest.fixture(scope="module")
def client(tiny_model: HEFormer) -> Client:
    return Client(tiny_model, INTERACTIVE)


def _logits(n: int) -> object:
    def check(out: np.ndarray) -> None:
        assert out.ndim == 2
        assert out.shape[1] == 10

    return check


@rule_settings(10)
@given(X=bad_arrays((3, 8, 8)))
def test_plaintext_and_simulated_logits(tiny_model: HEFormer, X: np.ndarray) -> None:
    assert_rule(lambda: predict_logits(tiny_model, X), X_NAMES, _logits(3))
    assert_rule(lambda: simulate(tiny_model, X)[0], X_NAMES, _logits(3))


@rule_settings(6)
@given(X=bad_arrays((2, 8, 8)))
def test_encrypt_inputs(client: Client, X: np.ndarray) -> None:
    def valid(message: Message) -> None:
        assert message.kind == "infer"
        assert len(message.blobs) == client.model.config.d

    assert_rule(lambda: client.encrypt_inputs(X), X_NAMES, valid)


@pytest.fixture(scope="module")
def logits(client: Client) -> Message:
    """Zero logits at the level the schedule's last stage leaves them."""
    import tenseal as ts

    [level] = set(client.schedule(True).reply.levels)
    blobs = []
    for _ in range(10):
        v = ts.ckks_vector(client.context, [0.0] * client.params.slots)
        for _ in range(level):
            v = v * 1.0
        blobs.append(v.serialize())
    return Message("logits", client.key, tuple(blobs))


@rule_settings(10)
@given(batch=bad_reals())
def test_decrypt_logits_batch(client: Client, logits: Message, batch: object) -> None:
    message = logits

    def valid(out: np.ndarray) -> None:
        assert out.shape == (int(batch), 10)  # type: ignore[call-overload]

    assert_rule(lambda: client.decrypt_logits(message, batch), ["batch"], valid)  # type: ignore[arg-type]


LABELS = st.one_of(st.just(np.array([0, 3, 9, 1])), bad_arrays((4,)))


@rule_settings(8)
@given(X=bad_arrays((4, 8, 8)), y=LABELS, lr=st.one_of(st.just(0.1), bad_reals()))
def test_simulated_step(
    tiny_model: HEFormer, X: np.ndarray, y: np.ndarray, lr: object
) -> None:
    def valid(result: object) -> None:
        weights = result.weights  # type: ignore[attr-defined]
        assert set(weights) >= {"q_a", "q_b"}

    assert_rule(
        lambda: simulated_step(tiny_model, X, y, lr),  # type: ignore[arg-type]
        [*X_NAMES, "y:", "y must", "lr"],
        valid,
    )


@rule_settings(10)
@given(
    X=bad_arrays((5, 4, 3)),
    y=st.one_of(st.just(np.array([0, 1, 1, 0, 2])), bad_arrays((5,))),
    k=st.one_of(st.sampled_from([3, np.int64(4)]), bad_reals()),
)
def test_sequences(X: np.ndarray, y: np.ndarray, k: object) -> None:
    def valid(data: Sequences) -> None:
        assert data.y.dtype == np.int64
        assert np.all((data.y >= 0) & (data.y < data.n_classes))

    assert_rule(
        lambda: Sequences(X, y, k),  # type: ignore[arg-type]
        [*X_NAMES, "y:", "y must", "n_classes", "sequences.x"],
        valid,
    )


@rule_settings(10)
@given(N=bad_reals(), scale=bad_reals())
def test_ckks_params(N: object, scale: object) -> None:
    assert_rule(
        lambda: CKKSParams(N, (60, 40, 60), scale),  # type: ignore[arg-type]
        ["poly_modulus_degree", "scale_bits", "coeff_mod_bit_sizes"],
    )


@rule_settings(10)
@given(data=st.binary(max_size=64))
def test_garbage_bytes(client: Client, data: bytes) -> None:
    assert_rule(lambda: Message.decode(data), ["message"])
    assert_rule(lambda: load_public(data), ["context"])
    assert_rule(lambda: load_ciphertext(client.context, data, "upload"), ["upload"])


@rule_settings(10)
@given(cut=st.floats(0.0, 0.999))
def test_truncated_ciphertext_and_message(client: Client, cut: float) -> None:
    blob = client._encrypt("infer", [np.zeros(8)]).blobs[0]
    part = blob[: int(cut * len(blob))]
    assert_rule(lambda: load_ciphertext(client.context, part, "upload", 8), ["upload"])
    wire = Message("infer", client.key, (blob,)).encode()
    assert_rule(lambda: Message.decode(wire[: int(cut * len(wire))]), ["message"])


def test_regressions_from_the_issue(
    client: Client, logits: Message, tiny_model: HEFormer
) -> None:
    server = Server.for_model(client.public_context(), tiny_model, INTERACTIVE)
    with pytest.raises(ValueError, match="X is empty"):
        client.predict(server, np.zeros((0, 8, 8)))
    with pytest.raises(ValueError, match="X has NaN"):
        client.predict(server, np.full((2, 8, 8), np.nan))
    with pytest.raises(ValueError, match="context: not a serialised TenSEAL"):
        Server.for_model(b"garbage", tiny_model, INTERACTIVE)
    blob = client.encrypt_inputs(np.zeros((1, 8, 8))).blobs[0]
    with pytest.raises(ValueError, match="ciphertext 0: not"):
        client.decrypt_logits(
            Message("logits", client.key, (blob[: len(blob) // 2],) * 10), 1
        )
    with pytest.raises(ValueError, match="batch"):
        client.decrypt_logits(logits, -1)
    assert client.decrypt_logits(logits, np.int64(3)).shape == (3, 10)
    with pytest.raises(ValueError, match="whole-number"):
        Sequences(np.zeros((2, 2, 2)), np.array([0.0, 1.7]), 2)
