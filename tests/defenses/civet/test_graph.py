"""Interval rules of the new layers and the traced-graph propagation.

Every rule is checked two ways: random points (and corners) of the input box never
leave the output box, and small cases with a known exact range.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from defenses.civet.bounds import GELU_MIN, SILU_MIN, Box, UnsupportedLayerError
from defenses.civet.graph import ibp, output_range, trace
from defenses.civet.model import init_parameters
from tests.defenses.civet.helpers import generator


def _batch_norm(cls: type[nn.Module], channels: int, seed: int) -> nn.Module:
    layer = cls(channels)
    g = generator(seed)
    with torch.no_grad():
        layer.running_mean.copy_(torch.randn(channels, generator=g))
        layer.running_var.copy_(torch.rand(channels, generator=g) + 0.1)
        layer.weight.copy_(torch.randn(channels, generator=g))  # both signs
        layer.bias.copy_(torch.randn(channels, generator=g))
    return layer.eval()


ELEMENTWISE = {
    "silu": lambda s: nn.SiLU(),
    "gelu": lambda s: nn.GELU(),
    "gelu-tanh": lambda s: nn.GELU(approximate="tanh"),
    "leaky-negative": lambda s: nn.LeakyReLU(-0.3),
    "leaky": lambda s: nn.LeakyReLU(0.2),
    "elu-negative": lambda s: nn.ELU(alpha=-0.5),
    "elu": lambda s: nn.ELU(),
    "batchnorm1d": lambda s: _batch_norm(nn.BatchNorm1d, 6, s),
    "dropout": lambda s: nn.Dropout(0.4).eval(),
}
SPATIAL = {
    "batchnorm2d": lambda s: _batch_norm(nn.BatchNorm2d, 2, s),
    "avgpool": lambda s: nn.AvgPool2d(2),
    "avgpool-padded": lambda s: nn.AvgPool2d(3, stride=2, padding=1),
    "adaptive-avgpool": lambda s: nn.AdaptiveAvgPool2d(3),
    "upsample-nearest": lambda s: nn.Upsample(scale_factor=2, mode="nearest"),
    "upsample-bilinear": lambda s: nn.Upsample(scale_factor=2, mode="bilinear"),
    "upsample-bilinear-corners": lambda s: nn.Upsample(
        size=(7, 9), mode="bilinear", align_corners=True
    ),
    "dropout2d": lambda s: nn.Dropout2d(0.4).eval(),
}


def _points(box: Box, n: int, seed: int) -> torch.Tensor:
    """Uniform points of the box plus random corners."""
    g = generator(seed)
    shape = (n, *box.lower.shape)
    uniform = torch.rand(shape, generator=g, dtype=box.lower.dtype)
    corners = torch.randint(0, 2, shape, generator=g).to(box.lower.dtype)
    t = torch.cat([uniform, corners])
    return box.lower + (box.upper - box.lower) * t


def _assert_inside(module: nn.Module, box: Box, seed: int) -> None:
    out = ibp(module, box)
    points = _points(box, 300, seed)
    values = module(points.reshape(-1, *box.lower.shape[1:]))
    values = values.reshape(points.shape[0], *out.lower.shape)
    assert bool((values >= out.lower - 1e-12).all())
    assert bool((values <= out.upper + 1e-12).all())


def _box(shape: tuple[int, ...], seed: int, width: float) -> Box:
    g = generator(seed)
    center = 2 * torch.randn(shape, generator=g, dtype=torch.float64)
    radius = width * torch.rand(shape, generator=g, dtype=torch.float64)
    return Box(center - radius, center + radius)


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), width=st.floats(0.0, 3.0))
def test_elementwise_rules_hold_by_sampling(name: str, seed: int, width: float) -> None:
    layer = ELEMENTWISE[name](seed).double()
    net = nn.Sequential(nn.Linear(4, 6), layer, nn.Linear(6, 3)).double()
    init_parameters(net, generator(seed))
    _assert_inside(layer, _box((2, 6), seed, width), seed)
    _assert_inside(net, _box((2, 4), seed + 1, width), seed)


@pytest.mark.parametrize("name", sorted(SPATIAL))
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), width=st.floats(0.0, 2.0))
def test_spatial_rules_hold_by_sampling(name: str, seed: int, width: float) -> None:
    layer = SPATIAL[name](seed).double()
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), layer, nn.Conv2d(2, 1, 3))
    net = net.double()
    init_parameters(net, generator(seed))
    _assert_inside(net, _box((2, 1, 6, 6), seed, width), seed)


def _exact(layer: nn.Module, lower: list[float], upper: list[float]) -> Box:
    box = Box(
        torch.tensor([lower], dtype=torch.float64), torch.tensor([upper]).double()
    )
    return ibp(layer, box)


def test_unimodal_activations_exact_ranges() -> None:
    silu = _exact(nn.SiLU(), [-2.0, 0.5, -5.0], [1.0, 2.0, -3.0])
    s = torch.sigmoid
    expect_low = [SILU_MIN[1], 0.5 * s(torch.tensor(0.5)), -3 * s(torch.tensor(-3.0))]
    expect_high = [
        1 * s(torch.tensor(1.0)),
        2 * s(torch.tensor(2.0)),
        -5 * s(-5.0 * torch.ones(())),
    ]
    assert silu.lower[0].tolist() == pytest.approx([float(v) for v in expect_low])
    assert silu.upper[0].tolist() == pytest.approx([float(v) for v in expect_high])
    assert pytest.approx((-1.2784645, -0.2784645), abs=1e-6) == SILU_MIN
    gelu = _exact(nn.GELU(), [-1.0], [1.0])
    assert gelu.lower.item() == pytest.approx(-0.1699712, abs=1e-6)
    assert gelu.upper.item() == pytest.approx(0.5 * (1 + math.erf(1 / math.sqrt(2))))
    assert GELU_MIN["none"][0] == pytest.approx(-0.7517915, abs=1e-6)
    leaky = _exact(nn.LeakyReLU(-0.5), [-2.0, -2.0], [1.0, -1.0])
    assert leaky.lower[0].tolist() == pytest.approx([0.0, 0.5])
    assert leaky.upper[0].tolist() == pytest.approx([1.0, 1.0])
    elu = _exact(nn.ELU(alpha=-1.0), [-1.0], [2.0])
    assert elu.lower.item() == 0.0
    assert elu.upper.item() == pytest.approx(2.0)


def test_batch_norm_eval_exact_range() -> None:
    layer = nn.BatchNorm1d(1, eps=0.0).double().eval()
    with torch.no_grad():
        layer.running_mean.fill_(1.0)
        layer.running_var.fill_(4.0)
        layer.weight.fill_(-2.0)
        layer.bias.fill_(0.5)
    out = _exact(layer, [0.0], [1.0])  # y = -2 (x - 1) / 2 + 0.5 = 1.5 - x
    assert (out.lower.item(), out.upper.item()) == pytest.approx((0.5, 1.5))


def test_pooling_and_upsampling_exact_ranges() -> None:
    low = torch.tensor([[[[0.0, 1.0], [2.0, 3.0]]]], dtype=torch.float64)
    box = Box(low, low + 1)
    pooled = ibp(nn.AvgPool2d(2), box)
    assert (pooled.lower.item(), pooled.upper.item()) == pytest.approx((1.5, 2.5))
    for mode in ("nearest", "bilinear"):
        layer = nn.Upsample(scale_factor=2, mode=mode)
        up = ibp(layer, box)
        assert torch.allclose(up.lower, layer(low))
        assert torch.allclose(up.upper, layer(low + 1))
    dropped = ibp(nn.Dropout(0.9).eval(), box)
    assert torch.equal(dropped.lower, low)


class Residual(nn.Module):
    """Residual additions, cat, chunk, reshapes, constant and box products."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.randn(6, generator=generator(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(x.shape[0], -1)
        h = h + F.silu(self.a(h))
        left, right = h.chunk(2, dim=1)
        g = F.gelu(self.b(left)) * right - 0.5 * left
        y = torch.cat([g, torch.flatten(right.unsqueeze(1), 1)], dim=1)
        y = (y * self.scale) @ self.a.weight.t() / 3.0
        return torch.sigmoid(1 - y[:, :4])


class Images(nn.Module):
    """A tutorial-style conv block with BatchNorm, pooling and a skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.bn = nn.BatchNorm2d(2)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.bn(self.conv(x)), -0.1)
        h = F.avg_pool2d(h, 2) + F.adaptive_avg_pool2d(x, 2)
        return F.elu(self.up(h), 0.5).flatten(1)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), width=st.floats(0.0, 1.0))
def test_traced_graphs_hold_by_sampling(seed: int, width: float) -> None:
    residual = Residual().double()
    init_parameters(residual, generator(seed))
    _assert_inside(residual, _box((2, 2, 3), seed, width), seed)
    images = Images().double()
    init_parameters(images, generator(seed))
    images.bn.running_var.fill_(0.5)
    images.eval()
    _assert_inside(images, _box((2, 1, 4, 4), seed, width), seed)


def test_exact_graph_case_and_output_range() -> None:
    class Signs(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(torch.cat([x, -x, x + x], dim=1))

    out = _exact(Signs(), [-1.0], [2.0])
    expect = torch.tanh(torch.tensor([[-1.0, -2.0, -2.0]], dtype=torch.float64))
    assert torch.allclose(out.lower, expect)
    assert output_range(trace(Signs())) == (-1.0, 1.0)
    assert output_range(trace(Residual())) == (0.0, 1.0)
    assert output_range(trace(nn.Sequential(nn.Linear(2, 2)))) is None


class Sine(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) + x


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


def test_operations_without_a_rule_are_named() -> None:
    box = Box(torch.zeros(1, 3), torch.ones(1, 3))
    with pytest.raises(UnsupportedLayerError, match=r"function sin\(\)"):
        ibp(Sine(), box)
    with pytest.raises(UnsupportedLayerError, match="LayerNorm"):
        ibp(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), box)
    with pytest.raises(UnsupportedLayerError, match=r"BatchNorm1d.*training mode"):
        ibp(nn.BatchNorm1d(3).train(), box)
    with pytest.raises(UnsupportedLayerError, match="bicubic"):
        ibp(
            nn.Upsample(scale_factor=2, mode="bicubic"),
            Box(box.lower[None], box.upper[None]),
        )
    with pytest.raises(TypeError, match=r"model\.forward could not be traced"):
        ibp(Branchy(), box)


class InPlaceChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu6(self.act(self.fc(x)), inplace=True) + x


class InPlaceReuse(InPlaceChain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.act(h) + h  # the ReLU overwrote h: both terms are relu(h)


def test_in_place_activations_are_bounded_or_refused() -> None:
    chain = InPlaceChain().double()
    box = _box((3, 3), 0, 1.0)
    before = box.lower.clone()
    _assert_inside(chain, box, 0)
    assert torch.equal(box.lower, before)  # the caller's box is not overwritten
    _assert_inside(
        nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True)).double(), box, 1
    )
    with pytest.raises(UnsupportedLayerError, match=r"function add\(\)"):
        ibp(InPlaceReuse().double(), box)
    with pytest.raises(UnsupportedLayerError, match="pooling indices"):
        ibp(nn.MaxPool1d(2, return_indices=True), Box(box.lower[None], box.upper[None]))


class InPlaceView(nn.Module):
    """The issue's modules: an in-place op on a view or slice of a tensor read again."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = nn.Linear(3, 64)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.how == "view":
            self.act(h.view(-1, 8, 8))
        elif self.how == "slice":
            F.relu(h[:, :32], inplace=True)
        elif self.how == "slice-joined":
            r = F.relu(h[:, :32], inplace=True)
            return torch.cat([r, h[:, 32:]], 1).sum(1, keepdim=True)
        elif self.how == "earlier-view":
            v = h.view(-1, 8, 8)
            F.leaky_relu(h[:, :32], -0.1, True)
            return v.flatten(1)[:, :2]
        elif self.how == "input":
            return self.out(F.relu(x, inplace=True).repeat(1, 1) @ self.fc.weight.T)
        return self.out(h)


@pytest.mark.parametrize(
    ("how", "layer"),
    [
        ("view", "layer 'act'"),
        ("slice", r"function relu\(\)"),
        ("slice-joined", r"function relu\(\)"),
        ("earlier-view", r"function leaky_relu\(\)"),
        ("input", "the input 'x'"),
    ],
)
def test_in_place_on_a_view_of_a_tensor_read_again_is_refused_by_name(
    how: str, layer: str
) -> None:
    module = InPlaceView(how).double()
    box = _box((2, 3), 7, 0.0)  # even a point box: the bound would be wrong
    with pytest.raises(UnsupportedLayerError, match=layer):
        ibp(module, box)


def test_in_place_on_a_view_nobody_reads_again_is_bounded() -> None:
    class Chain(InPlaceView):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.act(self.fc(x)).view(-1, 8, 8)
            return self.out(F.relu(h, True).flatten(1))

    _assert_inside(Chain("").double(), _box((2, 3), 8, 1.0), 8)


def test_keepdim_is_not_mistaken_for_inplace() -> None:
    class Sums(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(1, True) + F.relu(2.0 * x, True)

    box = _box((2, 3), 4, 1.0)
    out = ibp(Sums().double(), box)
    assert out.lower.shape == (2, 3)
    _assert_inside(Sums().double(), box, 4)
