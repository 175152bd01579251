"""The benchmarks' shared per-seed model and their integer parameters."""

from __future__ import annotations

import numpy as np
import torch

from ..models.heformer import HEFormer, ModelConfig
from ..models.train import TrainConfig, personalise, pretrain
from ..tasks import Sequences, client_transform


def personalised_model(
    data: Sequences,
    seed: int,
    config: ModelConfig,
    pretrain_epochs: int,
    polish_epochs: int,
    personal: int,
    personal_epochs: int,
) -> tuple[HEFormer, Sequences]:
    """The crypto benchmarks' model for one seed, and the client's data.

    The digit sequences are shuffled by ``seed``: the first 600 are the server's
    public data, the rest (client-transformed) the client's. The model is pretrained
    on the public part (``pretrain_epochs`` exact, ``polish_epochs`` polynomial) and
    personalised on the client's first ``personal`` sequences; later client rows are
    left for the benchmark's batch.
    """
    order = np.random.default_rng(seed).permutation(len(data))
    public = data.subset(order[:600])
    client = client_transform(data.subset(order[600:]))
    g = torch.Generator().manual_seed(seed)
    model = pretrain(
        public,
        config,
        g,
        TrainConfig(epochs=pretrain_epochs, batch=128),
        TrainConfig(epochs=polish_epochs, lr=3e-3, batch=128, penalty=10.0),
    )
    personalise(
        model,
        client.subset(np.arange(personal)),
        g,
        TrainConfig(epochs=personal_epochs, penalty=10.0),
    )
    return model, client
