from __future__ import annotations

import numpy as np
import pytest

from crypto.attacks import audit
from crypto.ckks import INTERACTIVE, make_context, public_bytes
from crypto.model import HEFormer
from crypto.protocol import Client, Message, Server
from crypto.tasks import Sequences
from crypto.train import predict_logits


@pytest.fixture(scope="module")
def pair(tiny_model: HEFormer) -> tuple[Client, Server]:
    client = Client(tiny_model, INTERACTIVE)
    return client, Server.for_model(client.public_context(), tiny_model, INTERACTIVE)


@pytest.mark.slow
def test_encrypted_inference_matches_plaintext(
    pair: tuple[Client, Server],
    tiny_model: HEFormer,
    tiny_data: tuple[Sequences, Sequences],
) -> None:
    client, server = pair
    X = tiny_data[1].X[100:160]
    encrypted = client.predict(server, X)
    plain = predict_logits(tiny_model, X)
    assert np.max(np.abs(encrypted - plain)) < 0.2
    assert np.mean(encrypted.argmax(1) == plain.argmax(1)) >= 0.95
    assert server.counts["refresh_rounds"] >= 3
    report = audit(server)
    assert report.clean, report


def test_server_refuses_private_context(tiny_model: HEFormer) -> None:
    ctx = make_context(INTERACTIVE)
    with pytest.raises(ValueError, match="public context"):
        Server.for_model(ctx.serialize(save_secret_key=True), tiny_model, INTERACTIVE)
    Server.for_model(public_bytes(ctx), tiny_model, INTERACTIVE)


def test_server_refuses_foreign_ciphertexts(
    pair: tuple[Client, Server],
    tiny_model: HEFormer,
    tiny_data: tuple[Sequences, Sequences],
) -> None:
    _, server = pair
    other = Client(tiny_model, INTERACTIVE)
    message = other.encrypt_inputs(tiny_data[1].X[:2])
    with pytest.raises(ValueError, match="another context"):
        server.infer(message, {}, other)
    with pytest.raises(TypeError, match="only Message"):
        server.infer(np.zeros(3), {}, other)  # type: ignore[arg-type]


def test_client_rejects_wrong_length_and_range(
    pair: tuple[Client, Server], tiny_data: tuple[Sequences, Sequences]
) -> None:
    client, server = pair
    with pytest.raises(ValueError, match="shape"):
        client.predict(server, np.zeros((2, 6, 8)))
    with pytest.raises(ValueError, match="calibrated range"):
        client.predict(server, np.full((2, 8, 8), 30.0))
    assert isinstance(client.encrypt_inputs(tiny_data[1].X[:1]), Message)
