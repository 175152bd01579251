"""User VAEs of varied construction that future rules must keep sound (issue 39).

Each is a plain ``nn.Module`` with ``encode`` / ``decode`` on 16 inputs (a 4x4
image for the convolutional one) and a 2-d latent, written the way a user would.
:data:`CERTIFIED` must get a certificate that no attack breaks; :data:`REFUSED`
must be refused, the message naming the cause.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, spectral_norm, weight_norm

from tests.defenses.civet.user_modules import IN as IN  # re-exported to the zoo tests
from tests.defenses.civet.user_modules import LATENT, UserVAE, redraw


def _init(model: nn.Module, seed: int) -> nn.Module:
    return redraw(model, seed, bias_scale=2.0)


class Base(UserVAE):
    """Linear encoder heads and a two-layer decoder; subclasses change the maps."""

    def __init__(self, seed: int = 0, hidden: int = 24) -> None:
        super().__init__(seed, hidden, logvar_range=(-4.0, 1.0), bias_scale=2.0)


class SoftplusThresholdZero(Base):
    """The issue's model: ``nn.Softplus(threshold=0)`` jumps from log 2 to 0."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.act = nn.Softplus(threshold=0.0)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.out(self.act(self.dec(z))))


class SoftplusFunctional(Base):
    """``F.softplus`` with beta 2 and a small threshold, in both halves."""

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.softplus(self.enc(x), beta=2.0, threshold=0.25)
        mu, logvar = self.heads(h).chunk(2, dim=1)
        return mu, F.softplus(logvar, -1.0, 0.1) - 1.0

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.out(F.softplus(self.dec(z), 3.0, 0.1)))


class LeakyFloat64(Base):
    """float64, a LeakyReLU with a negative slope, an ELU with alpha < 0."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.leaky, self.elu = nn.LeakyReLU(-0.3), nn.ELU(-0.5)
        self.double()

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.heads(self.leaky(self.enc(x))).chunk(2, dim=1)
        return mu, torch.tanh(logvar)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.out(self.elu(self.dec(z))))


class Clamps(Base):
    """Clamps everywhere: scalar limits, tensor limits, min > max (constant)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.register_buffer("low", torch.linspace(-0.5, 0.0, 24))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.clamp(self.enc(x), min=self.low, max=self.low + 1.5)
        mu, logvar = self.heads(h).chunk(2, dim=1)
        return mu.clip(-3.0, 3.0), logvar.clamp(min=0.5, max=-0.5)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return F.hardtanh(self.out(self.dec(z).clamp(min=0.0)), 0.0, 1.0)


class Conv(nn.Module):
    """4x4 images: Conv2d + eval BatchNorm + avg pool with a negative divisor."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.norm = nn.BatchNorm2d(3)
        self.pool = nn.AvgPool2d(2, divisor_override=-2)
        self.heads = nn.Linear(12, 2 * LATENT)
        self.dec = nn.Linear(LATENT, 12)
        self.up = nn.ConvTranspose2d(3, 1, 2, stride=2)
        _init(self, seed)
        with torch.no_grad():
            self.norm.running_mean.copy_(torch.tensor([0.1, -0.2, 0.3]))
            self.norm.running_var.copy_(torch.tensor([0.5, 2.0, 1.0]))
        self.eval()

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.pool(F.silu(self.norm(self.conv(x.view(-1, 1, 4, 4)))))
        mu, logvar = self.heads(h.flatten(1)).chunk(2, dim=1)
        return mu, logvar.clamp(-3.0, 1.0)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.dec(z)).view(-1, 3, 2, 2)
        return torch.sigmoid(self.up(h)).flatten(1)


class Residual(Base):
    """Residual blocks with SiLU and tanh-GELU, a concatenation and a product."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.block = nn.Linear(24, 24)
        self.mix = nn.Linear(48, 24)
        _init(self, seed + 1)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.dec(z))
        h = h + F.gelu(self.block(h), approximate="tanh")
        h = self.mix(torch.cat([h, torch.sigmoid(h) * h], dim=1))
        return torch.sigmoid(self.out(h))


class ParametrizedWeightNorm(Base):
    """The parametrization API's weight and spectral norm: bounded as they run."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        parametrizations.weight_norm(self.dec)
        parametrizations.spectral_norm(self.out)
        self.eval()


class OldWeightNorm(Base):
    """Old-style ``torch.nn.utils.weight_norm``: a forward pre-hook (refused)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        weight_norm(self.dec)


class OldSpectralNorm(Base):
    """Old-style ``torch.nn.utils.spectral_norm``: a forward pre-hook (refused)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        spectral_norm(self.out)


class StateOnSelf(Base):
    """An encoder feature stored on ``self`` and read by ``decode`` (refused)."""

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.relu = torch.relu(self.enc(x))
        mu, logvar = self.heads(self.relu).chunk(2, dim=1)
        return mu, logvar.clamp(-4.0, 1.0)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.out(torch.relu(self.dec(z))) + self.relu.mean())


class NaNInFloat32(Base):
    """Finite in float64, NaN in float32 where ``|z|`` > 1 (exp(100 z) overflows)."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        spike = torch.exp(100.0 * z[:, :1]) * torch.exp(-100.0 * z[:, :1])
        return torch.sigmoid(self.out(torch.relu(self.dec(z)))) * spike


class ValueBranch(Base):
    """Python control flow on a tensor value: fx cannot trace it (refused)."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        if z.sum() > 0:
            z = -z
        return super().decode(z)


class RoundingDivision(Base):
    """``torch.div(..., rounding_mode="floor")``: raises inside the rule (refused)."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return super().decode(torch.div(z, 2.0, rounding_mode="floor"))


def _large(seed: int = 0) -> Base:
    model = NaNInFloat32(seed)
    with torch.no_grad():
        model.heads.bias[LATENT:] = 1.0  # sigma near 1.6: |z| reaches past 1
    return model


CERTIFIED: dict[str, Callable[[], nn.Module]] = {
    "softplus-threshold-0": SoftplusThresholdZero,
    "softplus-functional": SoftplusFunctional,
    "leaky-float64": LeakyFloat64,
    "clamps": Clamps,
    "conv-batchnorm-pool": Conv,
    "residual": Residual,
    "parametrized-norms": ParametrizedWeightNorm,
}
"""Legitimate user VAEs: certified, then attacked."""

REFUSED: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "old-weight-norm": (OldWeightNorm, "layer 'dec' (Linear) carries the old-style"),
    "old-spectral-norm": (OldSpectralNorm, "old-style torch.nn.utils.spectral_norm"),
    "state-on-self": (StateOnSelf, "model.encode writes state on the module: 'relu'"),
    "nan-in-float32": (_large, "in its own dtype (torch.float32) is nan or inf"),
    "value-branch": (ValueBranch, "model.decode could not be traced"),
    "rounding-division": (RoundingDivision, "failed at function div()"),
}
"""User VAEs CIVET cannot bound, and a phrase naming the cause."""
