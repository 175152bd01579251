r"""The built-in VAE container, one implementation of the VAE protocol.

An encoder trunk :math:`h(x)` feeds two heads, the mean :math:`\mu(x)` and the
log-variance :math:`\log\sigma^2(x)` (clamped to ``logvar_range`` so that
:math:`\sigma` stays bounded); the latent is drawn by reparameterisation,
:math:`z = \mu(x) + \sigma(x) \odot \nu` with :math:`\nu \sim \mathcal N(0, I_d)`,
and the decoder :math:`D` ends in a sigmoid, so reconstructions lie in [0, 1].

The container's inputs and outputs are flat vectors of shape ``(n, n_features)``;
convolutional models reshape inside (``Unflatten`` / ``Flatten``). CIVET itself
needs only ``encode`` and ``decode`` (:mod:`defenses.civet.protocol`), so any user
module with those two methods is certified and trained the same way.
Parameters are initialised from a passed :class:`torch.Generator` (never the global
torch RNG): same generator state, same model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import nn

from defenses.civet.bounds import check_supported


class VAE(nn.Module):
    """A Gaussian-encoder VAE with a bounded decoder.

    Parameters
    ----------
    trunk, mu_head, logvar_head, decoder : torch.nn.Module
        Encoder trunk, its two heads and the decoder (each built from layers that
        :func:`defenses.civet.bounds.ibp` supports; checked here).
    n_features : int
        Length of the flat input and output vectors.
    latent_dim : int
        Dimension :math:`d` of the latent.
    logvar_range : (float, float)
        The log-variance is clamped to this interval.
    domain : (float, float)
        The valid input (and output) range.
    """

    def __init__(
        self,
        trunk: nn.Module,
        mu_head: nn.Module,
        logvar_head: nn.Module,
        decoder: nn.Module,
        n_features: int,
        latent_dim: int,
        logvar_range: tuple[float, float] = (-10.0, 4.0),
        domain: tuple[float, float] = (0.0, 1.0),
    ) -> None:
        super().__init__()
        if n_features < 1 or latent_dim < 1:
            raise ValueError(
                "n_features and latent_dim must be >= 1, got "
                f"{n_features!r} and {latent_dim!r}"
            )
        if not logvar_range[0] < logvar_range[1]:
            raise ValueError(f"logvar_range must be increasing, got {logvar_range!r}")
        if not domain[0] < domain[1]:
            raise ValueError(f"domain must be increasing, got {domain!r}")
        for part in (trunk, mu_head, logvar_head, decoder):
            check_supported(part)
        self.trunk = trunk
        self.mu_head = mu_head
        self.logvar_head = logvar_head
        self.decoder = decoder
        self.n_features = int(n_features)
        self.latent_dim = int(latent_dim)
        self.logvar_range = (float(logvar_range[0]), float(logvar_range[1]))
        self.domain = (float(domain[0]), float(domain[1]))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Return the mean and the clamped log-variance of :math:`q(z \mid x)`."""
        h = self.trunk(x)
        logvar = self.logvar_head(h).clamp(*self.logvar_range)
        mu: torch.Tensor = self.mu_head(h)
        return mu, logvar

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Reconstruction (flat, in [0, 1]) of latent codes ``z``."""
        out: torch.Tensor = self.decoder(z)
        return out

    def forward(self, x: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
        r"""Decode :math:`z = \mu(x) + \sigma(x) \odot \nu` for given noise ``nu``."""
        mu, logvar = self.encode(x)
        return self.decode(mu + torch.exp(0.5 * logvar) * nu)


def sse(recon: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum of squared errors per row over all non-batch dimensions (lower is better)."""
    return ((recon - target) ** 2).flatten(1).sum(dim=1)


def kl_standard_normal(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    r""":math:`\mathrm{KL}(\mathcal N(\mu, \sigma^2) \| \mathcal N(0, I))` per row."""
    return 0.5 * (mu**2 + logvar.exp() - 1.0 - logvar).sum(dim=1)


def init_parameters(model: nn.Module, generator: torch.Generator) -> nn.Module:
    r"""Re-initialise every Linear / Conv layer from ``generator`` (in place).

    Normalisation layers get their default affine parameters and fresh running
    statistics (deterministic).

    Weights and biases are drawn from :math:`U(-1/\sqrt{\text{fan\_in}},
    1/\sqrt{\text{fan\_in}})`, the scale of PyTorch's default initialisation.
    """
    for layer in model.modules():
        if isinstance(layer, nn.modules.batchnorm._NormBase):
            layer.reset_parameters()
        if not isinstance(layer, nn.Linear | nn.modules.conv._ConvNd):
            continue
        weight = layer.weight
        bound = 1.0 / math.sqrt(math.prod(weight.shape[1:]))
        with torch.no_grad():
            weight.uniform_(-bound, bound, generator=generator)
            if layer.bias is not None:
                layer.bias.uniform_(-bound, bound, generator=generator)
    return model


def _check_sizes(name: str, sizes: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(s) for s in sizes)
    if not out or any(s < 1 for s in out):
        raise ValueError(
            f"{name} must be a non-empty list of sizes >= 1, got {sizes!r}"
        )
    return out


def _mlp(sizes: Sequence[int], final: nn.Module | None) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b, device="meta"))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    if final is not None:
        layers.append(final)
    return nn.Sequential(*layers)


def _materialise(model: VAE, generator: torch.Generator) -> VAE:
    model.to_empty(device="cpu")
    init_parameters(model, generator)
    return model


def mlp_vae(
    n_features: int,
    latent_dim: int = 4,
    hidden: Sequence[int] = (64, 32),
    generator: torch.Generator | None = None,
) -> VAE:
    """An MLP VAE: ``n -> hidden -> (mu, logvar)``, ``d -> reversed(hidden) -> n``.

    Parameters
    ----------
    n_features : int
        Input (and output) length.
    latent_dim : int
        Latent dimension :math:`d`.
    hidden : sequence of int
        Encoder widths; the decoder mirrors them.
    generator : torch.Generator or None
        Source of the initial parameters (a fresh unseeded one if None).
    """
    h = _check_sizes("hidden", hidden)
    if latent_dim < 1 or n_features < 1:
        raise ValueError(
            f"n_features and latent_dim must be >= 1, got {n_features!r}, "
            f"{latent_dim!r}"
        )
    trunk = _mlp((n_features, *h), None)
    trunk.append(nn.ReLU())
    model = VAE(
        trunk=trunk,
        mu_head=nn.Linear(h[-1], latent_dim, device="meta"),
        logvar_head=nn.Linear(h[-1], latent_dim, device="meta"),
        decoder=_mlp((latent_dim, *reversed(h), n_features), nn.Sigmoid()),
        n_features=n_features,
        latent_dim=latent_dim,
    )
    return _materialise(model, generator or torch.Generator())


def conv_vae(
    image_shape: tuple[int, int],
    latent_dim: int = 4,
    channels: tuple[int, int] = (8, 16),
    hidden: int = 32,
    generator: torch.Generator | None = None,
) -> VAE:
    """A small convolutional VAE for one-channel images whose sides divide by 4.

    Encoder: two stride-2 3x3 convolutions (ReLU), a linear layer to ``hidden``, the
    heads. Decoder: linear layers back to the ``channels[1] x H/4 x W/4`` map, then
    two stride-2 4x4 transposed convolutions, the last one followed by a sigmoid.
    """
    height, width = (int(s) for s in image_shape)
    if height % 4 or width % 4 or height < 4 or width < 4:
        raise ValueError(
            f"image sides must be positive multiples of 4, got {image_shape!r}"
        )
    c1, c2 = _check_sizes("channels", channels)
    (hid,) = _check_sizes("hidden", [hidden])
    if latent_dim < 1:
        raise ValueError(f"latent_dim must be >= 1, got {latent_dim!r}")
    small = (c2, height // 4, width // 4)
    flat = c2 * (height // 4) * (width // 4)
    trunk = nn.Sequential(
        nn.Unflatten(1, (1, height, width)),
        nn.Conv2d(1, c1, 3, stride=2, padding=1, device="meta"),
        nn.ReLU(),
        nn.Conv2d(c1, c2, 3, stride=2, padding=1, device="meta"),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(flat, hid, device="meta"),
        nn.ReLU(),
    )
    decoder = nn.Sequential(
        nn.Linear(latent_dim, hid, device="meta"),
        nn.ReLU(),
        nn.Linear(hid, flat, device="meta"),
        nn.ReLU(),
        nn.Unflatten(1, small),
        nn.ConvTranspose2d(c2, c1, 4, stride=2, padding=1, device="meta"),
        nn.ReLU(),
        nn.ConvTranspose2d(c1, 1, 4, stride=2, padding=1, device="meta"),
        nn.Sigmoid(),
        nn.Flatten(),
    )
    model = VAE(
        trunk=trunk,
        mu_head=nn.Linear(hid, latent_dim, device="meta"),
        logvar_head=nn.Linear(hid, latent_dim, device="meta"),
        decoder=decoder,
        n_features=height * width,
        latent_dim=latent_dim,
    )
    return _materialise(model, generator or torch.Generator())
