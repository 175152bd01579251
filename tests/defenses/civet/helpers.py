from __future__ import annotations

import numpy as np
import torch

from defenses.civet.model import VAE, mlp_vae
from defenses.civet.scenario import CivetScenario


def generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def small_vae(seed: int = 0) -> VAE:
    return mlp_vae(16, latent_dim=2, hidden=(12, 8), generator=generator(seed))


def inputs(seed: int = 0, n: int = 6) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 16))


TINY = CivetScenario(
    data="digits",
    n_eval=12,
    epochs=5,
    batch_size=64,
    lr=0.02,
    train_fraction=0.2,
    eps=0.2,
    hidden=(32,),
    latent_dim=2,
    mc_samples=32,
    warmup=0,
)
