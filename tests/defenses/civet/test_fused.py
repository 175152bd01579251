"""Fused interval arithmetic (training speed) computes the registry's bounds.

The fused path of :mod:`defenses.civet.fused` (one product per Linear layer on
``[l | u]``) must give the graph path's bounds up to rounding, its hand-written
backward pass must equal autograd's, it must apply only to the built-in container
with plain chains, and the sampled support level of certified training must have
the stated law (an unbiased estimate of the weighted sum).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from defenses.civet import TrainConfig, conv_vae, mlp_vae
from defenses.civet.bounds import Box
from defenses.civet.certificate import sampled_levels, support_loss_bounds
from defenses.civet.fused import IntervalLinear, block, fused_parts
from defenses.civet.graph import propagate
from defenses.civet.protocol import as_vae
from defenses.civet.support import layer_cake_weights
from tests.defenses.civet.helpers import generator, inputs


def test_fused_bounds_equal_the_graph_path() -> None:
    model = mlp_vae(16, 2, (12, 8), generator(0)).double()
    vae = as_vae(model, inputs())
    fast = vae.fused()
    assert fast is not None
    x = torch.as_tensor(inputs(1, 5))
    box = Box.linf_ball(x, 0.1, (0.0, 1.0))
    mu, logvar = fast.latent_bounds(box)
    graph_mu, graph_logvar = (b for b in propagate(vae._graph("encode"), box))
    for mine, theirs in ((mu, graph_mu), (logvar, graph_logvar)):
        assert torch.allclose(mine.lower, theirs.lower, rtol=0, atol=1e-12)
        assert torch.allclose(mine.upper, theirs.upper, rtol=0, atol=1e-12)
    z = Box(mu.lower - 1.0, mu.upper + 1.0)
    out, graph_out = fast.output_bounds(z), propagate(vae._graph("decode"), z)
    assert torch.allclose(out.lower, graph_out.lower, rtol=0, atol=1e-12)
    assert torch.allclose(out.upper, graph_out.upper, rtol=0, atol=1e-12)


def test_interval_linear_backward_equals_autograd() -> None:
    g = generator(3)
    ends = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 3, generator=g, dtype=torch.float64)
    weight[0, 0] = 0.0  # clamp passes the gradient to both halves at 0
    weight.requires_grad_(True)
    bias = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(5, 8, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(
        (IntervalLinear.apply(ends, weight, bias) * upstream).sum(),  # type: ignore[no-untyped-call]
        (ends, weight, bias),
    )
    reference = torch.autograd.grad(
        (F.linear(ends, block(weight), torch.cat([bias, bias])) * upstream).sum(),
        (ends, weight, bias),
    )
    for a, b in zip(mine, reference, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_fusion_applies_to_plain_chains_of_the_container_only() -> None:
    assert fused_parts(mlp_vae(16, 2, (8,), generator(0))) is not None
    assert fused_parts(conv_vae((8, 8), 2, generator=generator(0))) is None
    model = mlp_vae(16, 2, (8,), generator(0))
    model.decoder[1] = nn.Softplus()  # not monotone everywhere: graph path
    assert fused_parts(model) is None

    class MyLinear(nn.Linear):
        pass

    model = mlp_vae(16, 2, (8,), generator(0))
    model.trunk[0] = MyLinear(16, 8)  # a subclass may compute something else
    assert fused_parts(model) is None


def test_a_method_replaced_on_the_instance_takes_the_graph_path() -> None:
    model = mlp_vae(16, 2, (8,), generator(0))
    model.decode = lambda z: 1.0 - model.decoder(z)  # type: ignore[method-assign]
    assert as_vae(model, inputs()).fused() is None
    assert as_vae(mlp_vae(16, 2, (8,), generator(0)), inputs()).fused() is not None


def test_sampled_levels_have_the_stated_law() -> None:
    weights = layer_cake_weights((0.5, 0.75, 0.9, 0.95))
    g = generator(0)
    draws = torch.cat([sampled_levels(weights, 128, g) for _ in range(200)])
    share = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert torch.allclose(share, weights / weights.sum(), atol=0.01)


def test_sampled_training_term_is_unbiased() -> None:
    model = mlp_vae(16, 2, (12, 8), generator(0))
    vae = as_vae(model, inputs())
    x = torch.as_tensor(inputs(2, 4), dtype=torch.float32)
    levels = (0.5, 0.75, 0.9, 0.95)
    weights = layer_cake_weights(levels).float()
    with torch.no_grad():
        exact = (weights[:, None] * support_loss_bounds(vae, x, x, 0.1, levels)).sum(0)
        from defenses.civet.certificate import sampled_support_bound

        g = generator(1)
        estimates = torch.stack(
            [sampled_support_bound(vae, x, 0.1, levels, weights, g) for _ in range(400)]
        )
    assert torch.allclose(estimates.mean(0), exact, rtol=0.05)


def test_support_sampling_is_validated() -> None:
    with pytest.raises(ValueError, match="support_sampling"):
        TrainConfig(support_sampling="yes")  # type: ignore[arg-type]
