"""Shared fixtures: one tiny trained model for the crypto tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from defense_suite.crypto.model import HEFormer, ModelConfig
from defense_suite.crypto.tasks import Sequences, client_transform, digit_sequences
from defense_suite.crypto.train import TrainConfig, personalise, pretrain


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
