from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from defenses.civet.bounds import Box, UnsupportedLayerError, check_supported
from defenses.civet.graph import ibp
from defenses.civet.model import conv_vae, init_parameters
from tests.defenses.civet.helpers import generator

ACTIVATIONS = [
    nn.ReLU(),
    nn.Sigmoid(),
    nn.Tanh(),
    nn.Softplus(),
    nn.ELU(),
    nn.LeakyReLU(0.1),
    nn.Hardtanh(-0.5, 0.7),
]


def _mlp(seed: int, act: nn.Module) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(5, 7), act, nn.Linear(7, 4), act, nn.Linear(4, 3))
    init_parameters(net, generator(seed))
    return net.double()


def _sample_inside(box: Box, n: int, seed: int) -> torch.Tensor:
    u = torch.rand(
        (n, *box.lower.shape[1:]), generator=generator(seed), dtype=box.lower.dtype
    )
    return box.lower + (box.upper - box.lower) * u


def test_linear_golden_vector() -> None:
    layer = nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -2.0]]))
        layer.bias.copy_(torch.tensor([0.5]))
    out = ibp(layer, Box(torch.zeros(1, 2), torch.ones(1, 2)))
    # exact range of x1 - 2 x2 + 0.5 over the unit square is [-1.5, 1.5]
    assert out.lower.item() == pytest.approx(-1.5)
    assert out.upper.item() == pytest.approx(1.5)


def test_relu_then_linear_golden_vector() -> None:
    net = nn.Sequential(nn.ReLU(), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        net[1].weight.copy_(torch.tensor([[1.0, 1.0]]))
    out = ibp(net, Box(torch.tensor([[-1.0, 0.5]]), torch.tensor([[2.0, 1.0]])))
    assert out.lower.item() == pytest.approx(0.5)
    assert out.upper.item() == pytest.approx(3.0)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    act=st.integers(0, len(ACTIVATIONS) - 1),
    width=st.floats(0.0, 1.0),
)
def test_mlp_bounds_are_sound(seed: int, act: int, width: float) -> None:
    net = _mlp(seed, ACTIVATIONS[act])
    center = torch.randn((2, 5), generator=generator(seed + 1), dtype=torch.float64)
    box = Box(center - width, center + width)
    out = ibp(net, box)
    points = _sample_inside(
        Box(box.lower.repeat(200, 1), box.upper.repeat(200, 1)), 400, seed
    )
    values = net(points)
    lower, upper = out.lower.repeat(200, 1), out.upper.repeat(200, 1)
    assert bool((values >= lower - 1e-12).all())
    assert bool((values <= upper + 1e-12).all())


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), width=st.floats(0.0, 0.5))
def test_conv_vae_bounds_are_sound(seed: int, width: float) -> None:
    model = conv_vae((8, 8), latent_dim=3, generator=generator(seed)).double()
    x = torch.rand((1, 64), generator=generator(seed + 1), dtype=torch.float64)
    box = Box.linf_ball(x, width, (0.0, 1.0))
    enc = ibp(model.trunk, box)
    many = Box(box.lower.repeat(300, 1), box.upper.repeat(300, 1))
    h = model.trunk(_sample_inside(many, 300, seed))
    assert bool((h >= enc.lower - 1e-10).all() & (h <= enc.upper + 1e-10).all())
    z_box = Box(
        -torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    )
    dec = ibp(model.decoder, z_box)
    z = _sample_inside(
        Box(z_box.lower.repeat(300, 1), z_box.upper.repeat(300, 1)), 300, seed
    )
    out = model.decoder(z)
    assert bool((out >= dec.lower - 1e-10).all() & (out <= dec.upper + 1e-10).all())


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    inner=st.floats(0.0, 0.5),
    extra=st.floats(0.0, 0.5),
)
def test_bounds_are_monotone_under_inclusion(
    seed: int, inner: float, extra: float
) -> None:
    net = _mlp(seed, nn.ReLU())
    center = torch.randn((3, 5), generator=generator(seed), dtype=torch.float64)
    small = ibp(net, Box(center - inner, center + inner))
    large = ibp(net, Box(center - inner - extra, center + inner + extra))
    assert bool((large.lower <= small.lower + 1e-12).all())
    assert bool((large.upper >= small.upper - 1e-12).all())


def test_point_box_gives_the_forward_pass() -> None:
    net = _mlp(3, nn.Sigmoid())
    x = torch.randn((4, 5), generator=generator(0), dtype=torch.float64)
    out = ibp(net, Box(x, x))
    assert torch.allclose(out.lower, net(x))
    assert torch.allclose(out.upper, net(x))


def test_bounds_carry_gradients() -> None:
    net = _mlp(0, nn.ReLU())
    out = ibp(
        net,
        Box(
            torch.zeros(1, 5, dtype=torch.float64),
            torch.ones(1, 5, dtype=torch.float64),
        ),
    )
    (out.upper - out.lower).sum().backward()
    grad = net[0].weight.grad
    assert grad is not None
    assert float(grad.abs().sum()) > 0


@pytest.mark.parametrize(
    "layer",
    [
        nn.BatchNorm1d(3),  # in training mode (batch statistics)
        nn.LayerNorm(3),
        nn.Hardswish(),
        nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"),
        nn.Dropout(0.5),  # in training mode
    ],
)
def test_unsupported_layer_is_named(layer: nn.Module) -> None:
    name = type(layer).__name__
    with pytest.raises(UnsupportedLayerError, match=name):
        check_supported(nn.Sequential(nn.Linear(3, 3), layer))
    with pytest.raises(UnsupportedLayerError, match=name):
        ibp(nn.Sequential(layer), Box(torch.zeros(1, 3), torch.ones(1, 3)))


def test_dropout_in_eval_mode_is_the_identity() -> None:
    layer = nn.Dropout(0.5).eval()
    box = Box(torch.zeros(1, 3), torch.ones(1, 3))
    out = ibp(layer, box)
    assert torch.equal(out.lower, box.lower)
    assert torch.equal(out.upper, box.upper)


def test_malformed_boxes_are_rejected() -> None:
    with pytest.raises(ValueError, match="lower <= upper"):
        ibp(nn.ReLU(), Box(torch.ones(1, 2), torch.zeros(1, 2)))
    with pytest.raises(ValueError, match="NaN"):
        ibp(nn.ReLU(), Box(torch.tensor([[float("nan")]]), torch.ones(1, 1)))
    with pytest.raises(ValueError, match="same shape"):
        ibp(nn.ReLU(), Box(torch.zeros(1, 2), torch.ones(1, 3)))


def test_linf_ball_is_cut_to_the_domain() -> None:
    box = Box.linf_ball(torch.tensor([[0.05, 0.5, 0.97]]), 0.1, (0.0, 1.0))
    assert torch.allclose(box.lower, torch.tensor([[0.0, 0.4, 0.87]]))
    assert torch.allclose(box.upper, torch.tensor([[0.15, 0.6, 1.0]]))
    assert bool(box.contains(torch.tensor([[0.0, 0.6, 0.9]]))[0])
    assert not bool(box.contains(torch.tensor([[0.0, 0.61, 0.9]]))[0])
