"""Certified training's one-node objective computes the registry's bounds.

:mod:`defenses.civet.stacked` computes the plain term, the certified term and the
KL term of certified training with its backward pass written out. Its value and
every parameter's gradient must equal autograd's through an independent reference
(the module's own ``encode``/``decode`` for the plain term, the traced graph path
of :mod:`defenses.civet.graph` for the bounds), including clamped log-variances,
zero weights, bias-free layers and frozen parameters; it must apply only to the
chains it was written for; and training through it must follow the ``[l | u]``
path step for step.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from defenses.civet import TrainConfig, mlp_vae, train_vae
from defenses.civet.bounds import Box
from defenses.civet.certificate import worst_sse
from defenses.civet.fused import _flatten, fused_parts
from defenses.civet.graph import propagate
from defenses.civet.model import VAE, kl_standard_normal, sse
from defenses.civet.protocol import VAEInterface, as_vae
from defenses.civet.stacked import Coefficients, Plan, civet_objective, plan
from tests.defenses.civet.helpers import generator, inputs

HOW = Coefficients(
    eps=0.1,
    domain=(0.0, 1.0),
    logvar_range=(-10.0, 4.0),
    plain=0.6,
    robust=0.4 * 0.95,
    kl=0.05,
)


def _plan(model: VAE) -> Plan | None:
    parts = [
        _flatten(p)
        for p in (model.trunk, model.mu_head, model.logvar_head, model.decoder)
    ]
    return plan(model, parts)  # type: ignore[arg-type]


def _reference(
    vae: VAEInterface, x: torch.Tensor, nu: torch.Tensor, k: torch.Tensor
) -> torch.Tensor:
    """The objective through autograd: the module itself and the traced graph."""
    mu, logvar = vae.encode(x)
    plain = sse(vae.decode(mu + torch.exp(0.5 * logvar) * nu), x)
    box = Box.linf_ball(x, HOW.eps, HOW.domain)
    mu_box, logvar_box = propagate(vae._graph("encode"), box)
    spread = k[:, None] * torch.exp(0.5 * logvar_box.upper)
    support = Box(mu_box.lower - spread, mu_box.upper + spread)
    out = propagate(vae._graph("decode"), support)
    robust = worst_sse(out, x)
    kl = kl_standard_normal(mu, logvar)
    return (HOW.plain * plain + HOW.robust * robust + HOW.kl * kl).mean()


def _compare(model: VAE, seed: int = 0) -> None:
    layout = _plan(model)
    assert layout is not None
    g = generator(seed + 10)
    x = torch.rand(7, model.n_features, dtype=torch.float64, generator=g)
    nu = torch.randn(7, model.latent_dim, dtype=torch.float64, generator=g)
    k = 3 * torch.rand(7, dtype=torch.float64, generator=g)
    vae = as_vae(model, x)
    params = [p for p in model.parameters() if p.requires_grad]
    mine = civet_objective(layout, layout.parameters(), x, nu, k, HOW)
    theirs = _reference(vae, x, nu, k)
    assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-12)
    for a, b in zip(
        torch.autograd.grad(mine, params),
        torch.autograd.grad(theirs, params),
        strict=True,
    ):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def test_objective_and_gradients_equal_autograd_through_the_graph_path() -> None:
    for seed in range(3):
        _compare(mlp_vae(16, 3, (12, 8), generator(seed)).double(), seed)


def test_clamped_logvar_and_zero_weights_get_autograd_gradients() -> None:
    model = mlp_vae(16, 3, (12, 8), generator(4)).double()
    with torch.no_grad():
        model.logvar_head.bias[0] = 30.0  # above the clamp for every row
        model.logvar_head.bias[1] = -40.0  # below it
        model.decoder[0].weight[0, 0] = 0.0  # d|W|/dW = sign(0) = 0
        model.trunk[0].weight[:, 3] = 0.0
    _compare(model, 4)


def test_bias_free_layers_and_frozen_parameters() -> None:
    g = generator(5)
    model = mlp_vae(16, 2, (12, 8), g).double()
    model.trunk[0] = nn.Linear(16, 12, bias=False, dtype=torch.float64)
    model.mu_head = nn.Linear(8, 2, bias=False, dtype=torch.float64)
    model.decoder[2] = nn.Linear(8, 12, bias=False, dtype=torch.float64)
    model.trunk[2].weight.requires_grad_(False)
    model.decoder[0].bias.requires_grad_(False)
    _compare(model, 5)
    layout = _plan(model)
    assert layout is not None
    x = torch.rand(3, 16, dtype=torch.float64, generator=g)
    loss = civet_objective(
        layout,
        layout.parameters(),
        x,
        torch.zeros(3, 2, dtype=torch.float64),
        torch.ones(3, dtype=torch.float64),
        HOW,
    )
    loss.backward()
    assert model.trunk[2].weight.grad is None
    assert model.decoder[0].bias.grad is None
    assert model.trunk[0].weight.grad is not None


def test_decoder_without_a_sigmoid() -> None:
    model = mlp_vae(16, 2, (12, 8), generator(6)).double()
    del model.decoder[-1]
    layout = _plan(model)
    assert layout is not None
    assert not layout.sigmoid
    _compare(model, 6)


def test_the_plan_covers_linear_relu_chains_only() -> None:
    assert _plan(mlp_vae(16, 2, (8,), generator(0))) is not None
    model = mlp_vae(16, 2, (8,), generator(0))
    model.trunk[1] = nn.Tanh()  # fusable (monotone), but not in the plan
    assert fused_parts(model) is not None
    assert _plan(model) is None
    model = mlp_vae(16, 2, (8,), generator(0))
    model.mu_head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert _plan(model) is None
    model = mlp_vae(16, 2, (8,), generator(0))
    model.decoder.insert(len(model.decoder) - 1, nn.ReLU())  # ReLU before Sigmoid
    assert _plan(model) is None
    model = mlp_vae(16, 2, (8,), generator(0))
    model.trunk.append(nn.ReLU())  # two ReLUs in a row
    assert _plan(model) is None


def _train(model: VAE, use_plan: bool) -> VAE:
    x = inputs(7, 40)
    vae = as_vae(model, x)
    fast = vae.fused()
    assert fast is not None
    assert fast.plan is not None
    if not use_plan:
        vae._fused[0] = dataclasses.replace(fast, plan=None)
    config = TrainConfig(epochs=3, batch_size=16, warmup=1, ramp=0.3, eps=0.1)
    train_vae(vae, x, "civet", config, generator(8), progress=False)
    return model


def test_training_through_the_plan_follows_the_interval_path() -> None:
    stacked = _train(mlp_vae(16, 2, (12, 8), generator(9)).double(), True)
    reference = _train(mlp_vae(16, 2, (12, 8), generator(9)).double(), False)
    untrained = mlp_vae(16, 2, (12, 8), generator(9)).double()
    moved = 0.0
    for a, b, c in zip(
        stacked.parameters(),
        reference.parameters(),
        untrained.parameters(),
        strict=True,
    ):
        assert torch.allclose(a, b, rtol=0, atol=1e-9)
        moved = max(moved, float((a - c).detach().abs().max()))
    assert moved > 1e-3  # the comparison is not between two untrained models
