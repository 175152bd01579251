"""User modules written to break CIVET's assumptions (issue 27), one per way.

Each is a small VAE of the protocol on 16 inputs with a 2-d latent. Some compute
what interval propagation cannot follow (in-place updates through a view or an
alias, functional dropout, buffers updated in forward, state read at trace time,
randomness frozen into the graph); the rest are legitimate variants (float64,
compiled) that must get a correct certificate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.defenses.civet.helpers import generator

IN, LATENT = 16, 2


def redraw(model: nn.Module, seed: int, bias_scale: float | None = None) -> nn.Module:
    """Every parameter ``N(0, 1) / sqrt(fan_in)`` from a generator seeded ``seed``.

    Vectors (biases) are divided by ``bias_scale`` instead where it is given.
    """
    g = generator(seed)
    with torch.no_grad():
        for p in model.parameters():
            scale = (
                p.shape[-1] ** 0.5 if p.ndim > 1 or bias_scale is None else bias_scale
            )
            p.copy_(torch.randn(p.shape, generator=g) / scale)
    return model


class UserVAE(nn.Module):
    """A plain MLP VAE; subclasses change one method (or the width and ranges).

    ``hidden`` units in the encoder and decoder, log-variances clamped to
    ``logvar_range``, weights by :func:`redraw` (``bias_scale`` passed on).
    """

    def __init__(
        self,
        seed: int = 0,
        hidden: int = 64,
        logvar_range: tuple[float, float] = (-6.0, 2.0),
        bias_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.enc = nn.Linear(IN, hidden)
        self.heads = nn.Linear(hidden, 2 * LATENT)
        self.dec = nn.Linear(LATENT, hidden)
        self.out = nn.Linear(hidden, IN)
        self.act = nn.ReLU(inplace=True)
        self.logvar_low, self.logvar_high = logvar_range
        redraw(self, seed, bias_scale)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.heads(torch.relu(self.enc(x))).chunk(2, dim=1)
        return mu, logvar.clamp(self.logvar_low, self.logvar_high)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.out(torch.relu(self.dec(z))))


class InPlaceView(UserVAE):
    """The issue's case: ``relu(h.view(-1, 8, 8), inplace=True)``, then ``h``."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        h = self.dec(z)
        self.act(h.view(-1, 8, 8))
        return torch.sigmoid(self.out(h))


class InPlaceSlice(UserVAE):
    """The issue's other case: ``F.relu(h[:, :32], inplace=True)``, then ``h``."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        h = self.dec(z) - 4.0
        F.relu(h[:, :32], inplace=True)
        return torch.sigmoid(self.out(h))


class AugmentedAlias(UserVAE):
    """``h += 1`` on a tensor another name holds: fx traces an out-of-place add."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        h = self.dec(z)
        g = h
        h += 1.0
        return torch.sigmoid(self.out(torch.relu(g + h)))


class FunctionalDropout(UserVAE):
    """``F.dropout(h, 0.2)``: ``training=True`` by default, random in eval too."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.out(F.dropout(torch.relu(self.dec(z)), 0.2)))


class BufferInForward(UserVAE):
    """``F.batch_norm(..., training=True)``: batch statistics, buffers move."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.register_buffer("mean", torch.zeros(64))
        self.register_buffer("var", torch.ones(64))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.batch_norm(self.enc(x), self.mean, self.var, training=True)
        mu, logvar = self.heads(torch.relu(h)).chunk(2, dim=1)
        return mu, logvar.clamp(-6.0, 2.0)


class CallCounter(UserVAE):
    """A buffer updated in forward and read by it (the graph freezes its value)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.register_buffer("calls", torch.zeros(()))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1.0)
        return torch.sigmoid(self.out(torch.relu(self.dec(z))) + self.calls)


class FrozenNoise(UserVAE):
    """Noise drawn inside decode: the graph holds one draw, the module another."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        noise = 3.0 * torch.randn(IN)
        return torch.sigmoid(self.out(torch.relu(self.dec(z))) + noise)


class BatchCoupled(UserVAE):
    """Each latent centred on the batch mean: a row's output depends on the others."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.out(torch.relu(self.dec(z - z.mean(0)))))


class NaNOutput(UserVAE):
    """Finite weights, NaN reconstructions."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.out(torch.relu(self.dec(z)))) * float("nan")


def nan_weights(seed: int = 0) -> UserVAE:
    model = UserVAE(seed)
    with torch.no_grad():
        model.out.weight[0, 0] = float("nan")
    return model


def float64(seed: int = 0) -> UserVAE:
    return UserVAE(seed).double()


def compiled(seed: int = 0) -> nn.Module:
    return torch.compile(UserVAE(seed))  # type: ignore[return-value]


def scripted(seed: int = 0) -> nn.Module:
    return torch.jit.script(UserVAE(seed))  # type: ignore[no-any-return]


REFUSED = {
    "in-place-view": (InPlaceView, "layer 'act'"),
    "in-place-slice": (InPlaceSlice, "function relu()"),
    "augmented-alias": (AugmentedAlias, "traced graph of model.decode differs"),
    "functional-dropout": (FunctionalDropout, "dropout"),
    "buffer-in-forward": (BufferInForward, "batch statistics"),
    "call-counter": (CallCounter, "writes state on the module: 'calls'"),
    "frozen-noise": (FrozenNoise, "traced graph of model.decode differs"),
    "batch-coupled": (BatchCoupled, "couples the rows of a batch"),
    "nan-output": (NaNOutput, "nan or inf"),
    "nan-weights": (nan_weights, "parameter 'out.weight'"),
}
"""Modules that must be refused, and a phrase the refusal must contain."""

ACCEPTED = {"plain": UserVAE, "float64": float64, "compiled": compiled}
"""Modules that must get a certificate the cross-check accepts."""
