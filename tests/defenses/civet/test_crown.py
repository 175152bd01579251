from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from defenses.civet.bounds import Box, UnsupportedLayerError
from defenses.civet.certificate import certify
from defenses.civet.crown import crown
from defenses.civet.graph import ibp
from defenses.civet.model import conv_vae, init_parameters, sse
from defenses.civet.support import halfwidth
from tests.defenses.civet.helpers import generator, inputs, small_vae


def _net(seed: int, final: nn.Module | None = None) -> nn.Sequential:
    layers = [nn.Linear(4, 12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3)]
    net = nn.Sequential(*layers, *([final] if final is not None else []))
    init_parameters(net, generator(seed))
    return net.double()


def test_single_unstable_relu_golden_vector() -> None:
    # y = relu(x) - 0.5 relu(x) on x in [-1, 2]; exact range [0, 1]
    net = nn.Sequential(
        nn.Linear(1, 1, bias=False), nn.ReLU(), nn.Linear(1, 1, bias=False)
    )
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[2].weight.fill_(0.5)
    out = crown(
        net.double(),
        Box(torch.tensor([[-1.0]]).double(), torch.tensor([[2.0]]).double()),
    )
    # upper: 0.5 * chord(2) = 1.0 (exact); lower: slope 1 since u > -l gives 0.5*(-1)
    # intersected with IBP's 0
    assert out.upper.item() == pytest.approx(1.0)
    assert out.lower.item() == pytest.approx(0.0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), width=st.floats(0.0, 1.0), sigmoid=st.booleans())
def test_crown_is_sound_and_never_looser_than_ibp(
    seed: int, width: float, sigmoid: bool
) -> None:
    net = _net(seed, nn.Sigmoid() if sigmoid else None)
    centre = torch.randn((2, 4), generator=generator(seed), dtype=torch.float64)
    box = Box(centre - width, centre + width)
    tight, loose = crown(net, box), ibp(net, box)
    assert bool((tight.lower >= loose.lower - 1e-12).all())
    assert bool((tight.upper <= loose.upper + 1e-12).all())
    u = torch.rand((500, 2, 4), generator=generator(seed + 1), dtype=torch.float64)
    values = net((box.lower + (box.upper - box.lower) * u).reshape(-1, 4)).reshape(
        500, 2, 3
    )
    assert bool((values >= tight.lower - 1e-9).all())
    assert bool((values <= tight.upper + 1e-9).all())


def test_crown_refuses_what_it_cannot_relax() -> None:
    with pytest.raises(UnsupportedLayerError, match="Sigmoid"):
        crown(
            nn.Sequential(nn.Linear(2, 2), nn.Sigmoid(), nn.Linear(2, 1)),
            Box(torch.zeros(1, 2), torch.ones(1, 2)),
        )
    model = conv_vae((8, 8), generator=generator(0))
    with pytest.raises(UnsupportedLayerError, match=r"Unflatten|Conv2d"):
        certify(model, np.full((1, 64), 0.5), 0.1, relaxation="crown")
    with pytest.raises(ValueError, match="relaxation must be one of"):
        certify(small_vae(), inputs(), 0.1, relaxation="zonotope")


def test_crown_certificate_is_sound_and_at_least_as_tight() -> None:
    model = small_vae(5).double()
    x = inputs(5)
    loose = certify(model, x, 0.1, 0.9)
    tight = certify(model, x, 0.1, 0.9, relaxation="crown")
    assert np.all(tight.bound <= loose.bound + 1e-9)
    g = generator(0)
    xt = torch.as_tensor(x)
    k = halfwidth(0.9, 2)
    for _ in range(20):
        x_adv = (
            xt + 0.1 * (2 * torch.rand(xt.shape, generator=g, dtype=torch.float64) - 1)
        ).clamp(0, 1)
        nu = k * (2 * torch.rand((6, 2), generator=g, dtype=torch.float64) - 1)
        with torch.no_grad():
            assert np.all(sse(model(x_adv, nu), xt).numpy() <= tight.bound + 1e-9)
