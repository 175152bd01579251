"""The CIVET scenarios' data and demo models.

Data, offline and seeded: scikit-learn's 8x8 digits, or synthetic clusters from
:func:`defenses.data.make_identities` squashed into (0, 1). Models: besides the
built-in container (:mod:`defenses.civet.model`), two VAEs written the way a user
writes one (plain ``nn.Module`` subclasses with ``encode`` / ``decode``), which the
bring-your-own-model benchmark certifies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from scipy.special import expit
from torch import nn

from defenses.arrays import FloatArray
from defenses.civet.model import init_parameters
from defenses.data import load_digits, make_identities

DATASETS = ("digits", "blobs")


def load_images(name: str, rng: np.random.Generator) -> tuple[FloatArray, np.ndarray]:
    """Rows in [0, 1] and labels: sklearn digits, or 10 synthetic 64-d clusters.

    ``blobs``: :func:`defenses.data.make_identities` (10 prototypes, 150 samples
    each, spread 0.6) passed through a logistic squash :math:`1/(1 + e^{-1.5x})`.
    """
    if name == "digits":
        data = load_digits()
        return data.X, data.y
    if name == "blobs":
        data, _ = make_identities(rng, n_classes=10, dim=64, per_class=150, spread=0.6)
        return np.asarray(expit(1.5 * data.X), dtype=np.float64), data.y
    raise ValueError(f"unknown data set {name!r}; available: {DATASETS}")


@dataclass(frozen=True)
class VAETask:
    """Training rows, the inputs under attack, the budget and the judge's seed."""

    train: FloatArray
    x_eval: FloatArray
    eps: float
    p: float
    image_shape: tuple[int, int] | None
    judge_seed: int
    reference_loss: FloatArray


class ConvVAE(nn.Module):
    """A convolutional VAE on flattened square images, written as a user would.

    Not the built-in container: ``encode`` reshapes the rows to images, runs two
    stride-2 convolutions and a dense layer into the two heads; ``decode`` runs
    dense layers, nearest and bilinear upsampling with convolutions, a sigmoid,
    and flattens back. CIVET sees it only through ``encode`` / ``decode``.
    """

    def __init__(
        self,
        side: int = 8,
        latent_dim: int = 4,
        channels: tuple[int, int] = (8, 16),
        hidden: int = 32,
    ) -> None:
        super().__init__()
        c1, c2 = channels
        self.side, self.small, self.c2 = side, side // 4, c2
        flat = c2 * self.small**2
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.fc = nn.Linear(flat, hidden)
        self.fc_mu = nn.Linear(hidden, latent_dim)
        self.fc_logvar = nn.Linear(hidden, latent_dim)
        self.fc_z = nn.Linear(latent_dim, hidden)
        self.fc_up = nn.Linear(hidden, flat)
        self.up = nn.Sequential(
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.Conv2d(c2, c1, 3, padding=1),
            nn.ReLU(),
            nn.Upsample(scale_factor=2, mode="bilinear"),
            nn.Conv2d(c1, 1, 3, padding=1),
        )

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log-variance of q(z | x) for flat rows ``x``."""
        h = self.features(x.view(-1, 1, self.side, self.side))
        h = F.relu(self.fc(torch.flatten(h, 1)))
        return self.fc_mu(h), self.fc_logvar(h)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Flat reconstructions in (0, 1)."""
        h = F.relu(self.fc_up(F.relu(self.fc_z(z))))
        h = self.up(h.view(-1, self.c2, self.small, self.small))
        return torch.sigmoid(h).flatten(1)


class ResidualBlock(nn.Module):
    """``h + W_2 relu(W_1 h)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The residual update."""
        out: torch.Tensor = h + self.fc2(F.relu(self.fc1(h)))
        return out


class ResidualMLPVAE(nn.Module):
    """An MLP VAE with residual blocks and one head split in two, as a user writes.

    ``encode``: a dense layer, residual blocks, one linear head whose output is
    chunked into (mu, logvar). ``decode``: a dense layer, residual blocks, a linear
    layer and a sigmoid.
    """

    def __init__(
        self,
        n_features: int = 64,
        latent_dim: int = 4,
        width: int = 64,
        blocks: int = 1,
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(n_features, width)
        self.enc = nn.Sequential(*(ResidualBlock(width) for _ in range(blocks)))
        self.head = nn.Linear(width, 2 * latent_dim)
        self.dec_in = nn.Linear(latent_dim, width)
        self.dec = nn.Sequential(*(ResidualBlock(width) for _ in range(blocks)))
        self.out = nn.Linear(width, n_features)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log-variance of q(z | x)."""
        h = self.enc(F.relu(self.inp(x)))
        mu, logvar = self.head(F.relu(h)).chunk(2, dim=1)
        return mu, logvar

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Reconstructions in (0, 1)."""
        h = self.dec(F.relu(self.dec_in(z)))
        return torch.sigmoid(self.out(F.relu(h)))


USER_ARCHS = ("user-conv", "user-resmlp")


def user_vae(
    arch: str,
    n_features: int,
    latent_dim: int,
    hidden: tuple[int, ...],
    generator: torch.Generator,
) -> nn.Module:
    """A user-style VAE (:class:`ConvVAE` or :class:`ResidualMLPVAE`).

    Built on the meta device and initialised from ``generator`` by
    :func:`~defenses.civet.model.init_parameters`, so the global torch RNG is never
    touched. ``hidden[-1]`` is the dense width (the residual width for
    "user-resmlp"; ``len(hidden)`` its number of blocks).
    """
    with torch.device("meta"):
        if arch == "user-conv":
            side = math.isqrt(n_features)
            if side * side != n_features or side % 4:
                raise ValueError(
                    f"arch='user-conv' needs square images with sides divisible by "
                    f"4, got {n_features} features"
                )
            model: nn.Module = ConvVAE(side, latent_dim, hidden=hidden[-1])
        elif arch == "user-resmlp":
            model = ResidualMLPVAE(n_features, latent_dim, hidden[-1], len(hidden))
        else:
            raise ValueError(f"arch must be one of {USER_ARCHS}, got {arch!r}")
    model.to_empty(device="cpu")
    return init_parameters(model, generator)
