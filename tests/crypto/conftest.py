"""Shared fixtures: one tiny trained model for the crypto tests, and a tiny BERT."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from defense_suite.crypto.models.heformer import HEFormer, ModelConfig
from defense_suite.crypto.models.train import TrainConfig, personalise, pretrain
from defense_suite.crypto.models.train import micro_model as build_micro
from defense_suite.crypto.tasks import Sequences, client_transform, digit_sequences
from tests.crypto.tiny_bert import N_TOKENS, texts

if TYPE_CHECKING:
    from defense_suite.crypto.conversion import HEBert


@pytest.fixture(scope="session")
def tiny_data() -> tuple[Sequences, Sequences]:
    data = digit_sequences()
    order = np.random.default_rng(0).permutation(len(data))
    return data.subset(order[:400]), client_transform(data.subset(order[400:560]))


@pytest.fixture(scope="session")
def tiny_model(tiny_data: tuple[Sequences, Sequences]) -> HEFormer:
    torch.set_num_threads(1)
    public, client = tiny_data
    g = torch.Generator().manual_seed(0)
    model = pretrain(
        public,
        ModelConfig(d=8, heads=1, ffn=8),
        g,
        TrainConfig(epochs=4, batch=128),
        TrainConfig(epochs=2, lr=3e-3, batch=128, penalty=10.0),
    )
    personalise(
        model, client.subset(np.arange(100)), g, TrainConfig(epochs=3, penalty=10.0)
    )
    return model


@pytest.fixture(scope="session")
def micro_model() -> HEFormer:
    """A d = 2, two-token model: encrypted sessions of a few seconds."""
    torch.set_num_threads(1)
    return build_micro(personal_head=False)


@pytest.fixture(scope="session")
def micro_head() -> HEFormer:
    """The micro model with a personal (secret, encrypted) head."""
    torch.set_num_threads(1)
    return build_micro(personal_head=True)


@pytest.fixture(scope="session")
def micro_inputs() -> np.ndarray:
    """Sequences in the micro model's calibrated ranges (its training inputs)."""
    return np.random.default_rng(0).random((64, 2, 3))


@pytest.fixture(scope="module")
def tokenizer() -> object:
    """A WordPiece tokenizer trained on the tiny BERT's corpus."""
    pytest.importorskip("transformers")
    from defense_suite.crypto.conversion.tokenizer import build_tokenizer

    return build_tokenizer(texts(), vocab_size=120)


@pytest.fixture(scope="module")
def converted(tokenizer: object) -> HEBert:
    """A tiny 2-layer BERT (width 8, 2 heads), converted, LoRA B made nonzero."""
    transformers = pytest.importorskip("transformers")
    from defense_suite.crypto.conversion import convert
    from defense_suite.crypto.conversion.tokenizer import encode

    torch.manual_seed(1)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=12,
        max_position_embeddings=8,
        num_labels=2,
        initializer_range=0.3,
    )
    teacher: torch.nn.Module = transformers.BertForSequenceClassification(config).eval()
    he, _ = convert(
        teacher, n_tokens=N_TOKENS, generator=torch.Generator().manual_seed(0)
    )
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in he.lora_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    ids, mask = encode(tokenizer, texts(), he)
    he.calibrate(ids, mask)
    return he
