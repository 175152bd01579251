"""The soundness suite: user VAEs certified then attacked, or refused by cause.

Each model of :data:`zoo.CERTIFIED` is certified (eps 0.1, p 0.95) and then
attacked with the joint input + noise PGD (40 steps, 3 restarts) inside the
level-p support's noise box, and sampled at 512 (input, noise) points of the ball
and the box; every error, evaluated by the user's module in its own dtype, must
stay under the certified bound. Each model of :data:`zoo.REFUSED` must be refused
with a message naming the cause.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from defenses.civet import certify
from defenses.civet.attacks import JointPGD, VAEView
from defenses.civet.bounds import Box
from defenses.civet.model import sse
from defenses.civet.protocol import as_vae, evaluation
from defenses.civet.support import halfwidth
from tests.defenses.civet.soundness.zoo import CERTIFIED, IN, LATENT, REFUSED

EPS, P = 0.1, 0.95
X = torch.rand(4, IN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def worst_error(model: torch.nn.Module, x: torch.Tensor, samples: int = 512) -> float:
    """Largest error found by joint PGD and sampling, per row (user's dtype)."""
    vae = as_vae(model, x)
    k = halfwidth(P, LATENT)
    guess = JointPGD(steps=40, restarts=3).run(
        VAEView(model, x.numpy(), EPS, k, P), np.random.default_rng(0)
    )
    assert guess.nu is not None
    g = torch.Generator().manual_seed(2)
    ball = Box.linf_ball(x, EPS, (0.0, 1.0))
    rows = torch.arange(x.shape[0]).repeat(samples)
    t = torch.rand((len(rows), IN), generator=g, dtype=x.dtype)
    t[::2] = t[::2].round()
    xs = ball.lower[rows] + (ball.upper - ball.lower)[rows] * t
    nus = k * (2 * torch.rand((len(rows), LATENT), generator=g, dtype=x.dtype) - 1)
    xs = torch.cat([xs, torch.as_tensor(guess.x_adv)])
    nus = torch.cat([nus, torch.as_tensor(guess.nu)])
    targets = torch.cat([x[rows], x])
    dtype = vae.dtype
    with torch.no_grad(), evaluation(model):
        loss = sse(vae.reconstruct(xs.to(dtype), nus.to(dtype)).double(), targets)
    per_row = torch.full((x.shape[0],), -torch.inf, dtype=torch.float64)
    index = torch.cat([rows, torch.arange(x.shape[0])])
    per_row = per_row.scatter_reduce(0, index, loss, "amax")
    return per_row  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(CERTIFIED))
def test_user_vae_is_certified_and_no_attack_breaks_it(name: str) -> None:
    model = CERTIFIED[name]()
    cert = certify(model, X, EPS, P)
    assert np.all(np.isfinite(cert.bound))
    worst = worst_error(model, X)
    bound = torch.as_tensor(cert.bound)
    assert bool((worst <= bound * (1 + 1e-6) + 1e-6).all()), (worst, bound)
    assert bool((worst > 0).all())  # the attack evaluated something real


@pytest.mark.parametrize("name", list(REFUSED))
def test_user_vae_is_refused_by_cause(name: str) -> None:
    make, phrase = REFUSED[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # old-style norms
        model = make()
    with pytest.raises((TypeError, ValueError)) as error:
        certify(model, X, EPS, P)
    assert phrase.lower() in str(error.value).lower()
