"""Plaintext training with the HE approximations in the loop.

The recipe of Rho et al. (2025), scaled down:

1. *pretrain* every base weight on public data with the exact functions and a range
   penalty (Sec. 4: variance/range penalties keep inputs inside the polynomial
   domains);
2. *calibrate* the ranges (with a margin) and fit the polynomials;
3. continue training in *polynomial mode*, so the deployed model is exactly the
   function evaluated under CKKS;
4. *personalise* on the client's data with only LoRA (Q, K, V) trained, every
   other weight frozen (optionally with CKKS-like noise: the HE simulation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from defenses.checks import check_int, check_real

from ..he.approx import RangeError
from ..tasks import Sequences, check_sequences
from .heformer import HEFormer, ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser settings.

    Parameters
    ----------
    epochs : int
        Passes over the data (>= 1).
    lr : float
        Adam learning rate (> 0).
    batch : int
        Mini-batch size (>= 1).
    penalty : float
        Weight of the range penalty (>= 0).
    noise : float
        HE-simulation noise standard deviation (>= 0).
    """

    epochs: int = 30
    lr: float = 1e-2
    batch: int = 64
    penalty: float = 1.0
    noise: float = 0.0

    def __post_init__(self) -> None:
        check_int("TrainConfig.epochs", self.epochs, 1)
        check_real("TrainConfig.lr", self.lr, 0.0, open_low=True)
        check_int("TrainConfig.batch", self.batch, 1)
        check_real("TrainConfig.penalty", self.penalty, 0.0)
        check_real("TrainConfig.noise", self.noise, 0.0)


def _tensor(data: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.as_tensor(data.X, dtype=torch.float64), torch.as_tensor(data.y)


def train(
    model: HEFormer,
    data: Sequences,
    parameters: list[nn.Parameter],
    config: TrainConfig,
    generator: torch.Generator,
    poly: bool,
) -> list[float]:
    """Minimise cross-entropy (+ range penalty) over ``parameters``; return losses."""
    X, y = _tensor(data)
    trainable = {id(p) for p in parameters}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    optimiser = torch.optim.Adam(parameters, lr=config.lr)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in tqdm(range(config.epochs), disable=None, desc="train", leave=False):
            order = torch.randperm(X.shape[0], generator=generator)
            total = 0.0
            for start in range(0, X.shape[0], config.batch):
                index = order[start : start + config.batch]
                trace: dict[str, torch.Tensor] = {}
                logits = model(
                    X[index],
                    poly=poly,
                    noise=config.noise,
                    generator=generator,
                    trace=trace,
                )
                loss = nn.functional.cross_entropy(logits, y[index])
                if config.penalty:
                    loss = loss + config.penalty * model.range_penalty(trace)
                optimiser.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                optimiser.step()
                total += float(loss.detach()) * index.numel()
            losses.append(total / X.shape[0])
    finally:
        torch.set_num_threads(threads)
        for p in model.parameters():
            p.requires_grad_(True)
    logger.info("trained %d epochs, final loss %.4f", config.epochs, losses[-1])
    return losses


def pretrain(
    data: Sequences,
    config: ModelConfig,
    generator: torch.Generator,
    exact: TrainConfig = TrainConfig(),
    polished: TrainConfig = TrainConfig(epochs=10, lr=3e-3, penalty=10.0),
) -> HEFormer:
    """Train the base model (exact functions), calibrate, then polish in poly mode.

    A deeper model (``n_layers >= 2``) is calibrated again after polishing: a later
    block's ranges move with every earlier block's weights, which the range penalty
    bounds only softly. The recalibration refits the polynomials to the exact
    functions on the new ranges; a one-layer model keeps the polished polynomials.
    """
    model = HEFormer(config, generator)
    X = torch.as_tensor(data.X, dtype=torch.float64)
    train(model, data, model.base_parameters(), exact, generator, poly=False)
    model.calibrate(X, margin=2.0)
    if config.attention == "gk":
        train(model, data, model.base_parameters(), polished, generator, poly=True)
        if config.n_layers > 1:
            model.calibrate(X, margin=2.0)
    return model


def personalise(
    model: HEFormer,
    data: Sequences,
    generator: torch.Generator,
    config: TrainConfig = TrainConfig(epochs=20, lr=1e-2, penalty=10.0),
) -> list[float]:
    """LoRA fine-tuning: Q, K, V adapters (and the head), everything else frozen.

    The head is trained when the model's ``personal_head`` is set, as in the paper.
    The trained weights are the client's secret: encrypted inference sends them
    as ciphertexts, the server holds only the frozen rest in plaintext.
    """
    poly = model.config.attention == "gk"
    return train(model, data, model.personal_parameters(), config, generator, poly)


def predict_logits(model: HEFormer, X: np.ndarray, guard: bool = True) -> np.ndarray:
    """Plaintext logits of the deployed (polynomial) model, as float64."""
    X = check_sequences(X, model.config.n_tokens, model.config.token_dim)
    poly = model.config.attention == "gk" and model.calibration.calibrated
    with torch.no_grad():
        try:
            out = model(
                torch.as_tensor(X, dtype=torch.float64), poly=poly, guard=guard and poly
            )
        except RangeError as err:
            raise RangeError(f"X leaves the model's calibrated ranges: {err}") from None
    return np.asarray(out.numpy(), dtype=np.float64)


def micro_model(personal_head: bool = True, seed: int = 0) -> HEFormer:
    """A trained micro HEFormer: 2 tokens of 3 features, d = 2, one head.

    Encrypted sessions on it take seconds: the model of the tests' quick
    encrypted checks and of the answer-floor benchmark
    (:mod:`crypto.benchmark.floor`). Trained on 64 random sequences labelled
    :math:`[x_{0,0} > x_{1,1}]` (``seed`` draws them and the initial weights);
    ``personal_head`` makes the head the client's secret.
    """
    rng = np.random.default_rng(seed)
    X = rng.random((64, 2, 3))
    data = Sequences(X, (X[:, 0, 0] > X[:, 1, 1]).astype(np.int64), 2)
    g = torch.Generator().manual_seed(seed)
    config = ModelConfig(
        n_tokens=2,
        token_dim=3,
        d=2,
        heads=1,
        ffn=2,
        n_classes=2,
        personal_head=personal_head,
    )
    fast = TrainConfig(epochs=1, batch=32, lr=3e-3, penalty=10.0)
    model = pretrain(data, config, g, TrainConfig(epochs=2, batch=32), fast)
    personalise(model, data, g, TrainConfig(epochs=1, batch=32, penalty=10.0))
    return model
