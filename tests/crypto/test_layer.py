from __future__ import annotations

import numpy as np
import pytest
import torch

from defense_suite.crypto.attacks import audit
from defense_suite.crypto.benchmark.layer import layer_benchmark
from defense_suite.crypto.he.ckks import NON_INTERACTIVE
from defense_suite.crypto.models.heformer import HEFormer, ModelConfig
from defense_suite.crypto.models.train import (
    TrainConfig,
    personalise,
    predict_logits,
    pretrain,
)
from defense_suite.crypto.protocol.client import Client, Server
from defense_suite.crypto.tasks import Sequences


def test_non_interactive_chain_is_secure_and_deep_enough() -> None:
    assert NON_INTERACTIVE.log_q <= 881
    assert NON_INTERACTIVE.levels >= 24


def test_layer_benchmark_bad_params() -> None:
    with pytest.raises(ValueError, match="batch"):
        list(layer_benchmark({"batch": 0}, [0]))
    with pytest.raises(ValueError, match="transport"):
        list(layer_benchmark({"transport": "pigeon"}, [0]))


@pytest.mark.slow
def test_non_interactive_layer_in_tenseal() -> None:
    rng = np.random.default_rng(0)
    X = rng.random((96, 2, 3))
    data = Sequences(X, (X[:, 0, 0] > X[:, 1, 1]).astype(np.int64), 2)
    g = torch.Generator().manual_seed(0)
    model: HEFormer = pretrain(
        data.subset(np.arange(64)),
        ModelConfig(n_tokens=2, token_dim=3, d=2, heads=1, ffn=2, n_classes=2),
        g,
        TrainConfig(epochs=3, batch=32),
        TrainConfig(epochs=1, batch=32, lr=3e-3, penalty=10.0),
    )
    personalise(model, data.subset(np.arange(64)), g, TrainConfig(epochs=1, batch=32))
    client = Client(model, NON_INTERACTIVE)
    server = Server.for_model(client.public_context(), model, NON_INTERACTIVE)
    test = data.X[64:72]
    encrypted = client.predict(server, test, interactive=False)
    plain = predict_logits(model, test)
    # measured: encrypted logits ~1.05x the plaintext ones (max error 0.018)
    assert np.max(np.abs(encrypted - plain)) < 0.05
    assert np.all(encrypted.argmax(1) == plain.argmax(1))
    assert server.counts.get("refresh_rounds", 0) == 0
    assert server.counts.get("roll_rounds", 0) == 0
    assert client.refreshes == 0
    assert audit(server).clean


def test_personal_head_travels_encrypted() -> None:
    from defense_suite.crypto.program.heformer import HEWeights, lora_factors, simulate

    rng = np.random.default_rng(0)
    X = rng.random((64, 2, 3))
    data = Sequences(X, (X[:, 0, 0] > X[:, 1, 1]).astype(np.int64), 2)
    g = torch.Generator().manual_seed(0)
    config = ModelConfig(
        n_tokens=2, token_dim=3, d=2, heads=1, ffn=2, n_classes=2, personal_head=True
    )
    model = pretrain(
        data, config, g, TrainConfig(epochs=1, batch=32), TrainConfig(epochs=1)
    )
    head = [p.detach().clone() for p in model.head_parameters()]
    personalise(model, data, g, TrainConfig(epochs=1, batch=32))
    assert any(
        not torch.equal(a, b)
        for a, b in zip(head, model.head_parameters(), strict=True)
    )
    public = HEWeights.from_model(model)
    assert not public.pool.any()
    assert not public.classifier.any()
    assert {"pool", "classifier"} <= set(lora_factors(model))
    logits, _ = simulate(model, X[:8])
    assert np.max(np.abs(logits - predict_logits(model, X[:8]))) < 1e-9
    with pytest.raises(ValueError, match="personal_head"):
        ModelConfig(personal_head=1)  # type: ignore[arg-type]
