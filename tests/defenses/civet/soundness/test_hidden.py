"""VAEs that hide a known large-error point from gradient attacks (SoundnessBench).

In the spirit of SoundnessBench (Zhou et al., 2024: verifiers tested on networks
built to hide a known counterexample from gradient attacks), each VAE gets a
*needle* in its decoder: ``H * relu(1 - a * |z - z*|_1)`` added to the
pre-sigmoid output in the direction away from the target, zero (with zero
gradient) outside an L1 ball of radius ``1/a`` around ``z* = mu(x) + sigma(x) nu*``,
a point of the noise box ``|nu_i| <= k`` at the centre input. The hidden error
there is known; the joint PGD attack and sampling do not find it (asserted, with
fixed seeds), and CIVET must never certify a bound below it. One model is
untrained, one is first trained with CIVET (tight bounds), then the needle is
planted.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from defenses.civet import CheckConfig, TrainConfig, certify, train_vae
from defenses.civet.support import halfwidth
from tests.defenses.civet.soundness.test_zoo import EPS, P, worst_error
from tests.defenses.civet.soundness.zoo import IN, LATENT, Base


class Needle(Base):
    """A VAE whose decoder hides a spike around ``centre`` (buffers, set later)."""

    def __init__(self, seed: int = 0, sharpness: float = 60.0) -> None:
        super().__init__(seed)
        self.sharpness = sharpness
        self.register_buffer("centre", torch.zeros(1, LATENT))
        self.register_buffer("push", torch.zeros(1, IN))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        gap = z - self.centre
        distance = (F.relu(gap) + F.relu(-gap)).sum(dim=1, keepdim=True)
        spike = F.relu(1.0 - self.sharpness * distance)
        return torch.sigmoid(self.out(torch.relu(self.dec(z))) + spike * self.push)

    def plant(self, x: torch.Tensor, fraction: float) -> torch.Tensor:
        """Hide the spike at ``nu* = fraction * k``; return the hidden error per row."""
        with torch.no_grad():
            mu, logvar = self.encode(x[:1])
            nu = fraction * halfwidth(P, LATENT) * torch.tensor([[1.0, -1.0]])
            self.centre.copy_(mu + torch.exp(0.5 * logvar) * nu)
            self.push.copy_(torch.where(x[:1] > 0.5, -30.0, 30.0))
            z = mu + torch.exp(0.5 * logvar) * nu
            return ((self.decode(z) - x[:1]) ** 2).sum(dim=1)


X = torch.rand(1, IN, generator=torch.Generator().manual_seed(5))


def _trained() -> Needle:
    model = Needle(1)
    data = torch.rand(256, IN, generator=torch.Generator().manual_seed(6))
    config = TrainConfig(epochs=6, batch_size=64, lr=0.01, warmup=1, eps=EPS)
    train_vae(model, data, "civet", config, torch.Generator().manual_seed(7), False)
    return model


@pytest.mark.parametrize("trained", [False, True], ids=["untrained", "civet-trained"])
def test_a_hidden_counterexample_is_never_certified_away(trained: bool) -> None:
    model = _trained() if trained else Needle(0)
    clean = certify(model, X, EPS, P, check=_quick()).bound  # before the needle
    hidden = float(model.plant(X, 0.55)[0])
    found = float(worst_error(model, X.double())[0])
    assert hidden > 2.0 * found  # the attacks do not find it: it is hidden
    if trained:  # far above the tight bound the model had before
        assert hidden > 2.0 * float(clean[0])
    cert = certify(model, X, EPS, P)
    exact = float(copy.deepcopy(model).double().plant(X.double(), 0.55)[0])
    assert float(cert.bound[0]) >= exact  # CIVET never certifies below it
    assert float(cert.bound[0]) >= hidden * (1 - 1e-6)  # float32: rounding only
    assert np.isfinite(cert.bound[0])


def _quick() -> CheckConfig:
    return CheckConfig(samples=4, steps=2)


def test_the_spike_is_flat_outside_its_ball() -> None:
    """Gradients see nothing of the needle away from it (why attacks miss it)."""
    model = Needle(0)
    model.plant(X, 0.55)
    z = (model.centre + 0.1).requires_grad_(True)
    spike_free = Needle(0)
    spike_free.load_state_dict({**model.state_dict(), "push": torch.zeros(1, IN)})
    out = model.decode(z).sum()
    (grad,) = torch.autograd.grad(out, z)
    (reference,) = torch.autograd.grad(spike_free.decode(z).sum(), z)
    assert torch.equal(grad, reference)
    assert isinstance(model, nn.Module)
