"""One sampling case per layer class of :data:`defenses.civet.bounds.LAYER_RULES`.

Each case draws the layer's parameters (degenerate ones included: negative slopes,
softplus thresholds at and near 0 and negative betas, equal clamp limits, negative
BatchNorm scales and average-pool divisors) and returns a
:class:`~tests.defenses.civet.soundness.cases.Setup` whose op is the layer itself
in float64 and eval mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

from defenses.civet.bounds import GELU_MIN, LINEAR_MODES, POOLS, SILU_MIN
from tests.defenses.civet.soundness.cases import (
    BETAS,
    SLOPES,
    THRESHOLDS,
    Make,
    Setup,
    _k,
    _seed,
)


def _randomised(layer: nn.Module, data: st.DataObject) -> nn.Module:
    g = _seed(data)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer.double().eval()


def _simple(build: Callable[[], nn.Module], *specials: float) -> Make:
    return lambda data: Setup(build().double().eval(), (_k(data),), specials)


def _conv(cls: type[nn.Module], dims: int) -> Make:
    def make(data: st.DataObject) -> Setup:
        cin, cout = _k(data, 1, 3), _k(data, 1, 3)
        kwargs: dict[str, Any] = {
            "stride": data.draw(st.integers(1, 2), "stride"),
            "bias": data.draw(st.booleans(), "bias"),
        }
        if cls in (nn.Conv1d, nn.Conv2d):
            kwargs["padding"] = data.draw(st.sampled_from([0, 1, "same"]))
            if kwargs["padding"] == "same":
                kwargs["stride"] = 1
        else:
            kwargs["padding"] = data.draw(st.integers(0, 1), "padding")
        layer = cls(cin, cout, data.draw(st.integers(1, 3), "kernel"), **kwargs)
        return Setup(_randomised(layer, data), (cin,) + (4,) * dims)

    return make


def _linear(data: st.DataObject) -> Setup:
    k, m = _k(data), _k(data)
    bias = data.draw(st.booleans(), "bias")
    return Setup(_randomised(nn.Linear(k, m, bias=bias), data), (k,))


def _batch_norm(cls: type[nn.Module], dims: int) -> Make:
    def make(data: st.DataObject) -> Setup:
        c = _k(data, 1, 3)
        layer = cls(c, affine=data.draw(st.booleans(), "affine"))
        g = _seed(data)
        with torch.no_grad():
            layer.running_mean.copy_(torch.randn(c, generator=g))
            layer.running_var.copy_(torch.rand(c, generator=g) * 3 + 1e-3)
        return Setup(_randomised(layer, data), (c,) + (3,) * dims)

    return make


def _dropout(cls: type[nn.Module], dims: int) -> Make:
    return lambda data: Setup(cls(0.5).double().eval(), (2,) + (3,) * dims)


def _pool(cls: type[nn.Module]) -> Make:
    dims = 1 if "1d" in cls.__name__ else 2

    def make(data: st.DataObject) -> Setup:
        if cls.__name__.startswith("Adaptive"):
            layer = cls(3 if dims == 1 else (2, 3))
        elif cls is nn.AvgPool2d:
            divisor = data.draw(st.sampled_from([None, 2, -1, -3]), "divisor")
            layer = cls(2, 1, 1, divisor_override=divisor)
        elif cls is nn.AvgPool1d:
            layer = cls(2, 1, 1, count_include_pad=data.draw(st.booleans()))
        else:
            layer = cls(2, data.draw(st.integers(1, 2)), ceil_mode=True)
        return Setup(layer, (2,) + (5,) * dims)

    return make


def _upsample(data: st.DataObject) -> Setup:
    mode = data.draw(st.sampled_from(LINEAR_MODES), "mode")
    if mode == "area":  # nn.Upsample accepts area only with a size
        return Setup(nn.Upsample(size=(3, 2), mode=mode), (2, 4, 4))
    dims = {"linear": 1, "bilinear": 2, "trilinear": 3}.get(mode, 2)
    corners = (
        data.draw(st.booleans(), "align_corners")
        if mode in ("linear", "bilinear", "trilinear")
        else None
    )
    layer = nn.Upsample(scale_factor=2.0, mode=mode, align_corners=corners)
    return Setup(layer, (2,) + (3,) * dims)


def _hardtanh(data: st.DataObject) -> Setup:
    low = data.draw(st.sampled_from([-1.0, -0.2, 0.0, 0.5]), "min")
    high = low + data.draw(st.sampled_from([1e-9, 0.3, 2.0]), "span")
    return Setup(nn.Hardtanh(low, high), (_k(data),), (low, high))


def _softplus(data: st.DataObject) -> Setup:
    beta, t = data.draw(BETAS, "beta"), data.draw(THRESHOLDS, "threshold")
    return Setup(nn.Softplus(beta, t), (_k(data),), (t / beta,))


def _sloped(cls: type[nn.Module]) -> Make:
    def make(data: st.DataObject) -> Setup:
        return Setup(cls(data.draw(SLOPES, "slope")), (_k(data),), (0.0,))

    return make


def _gelu(data: st.DataObject) -> Setup:
    mode = data.draw(st.sampled_from(["none", "tanh"]), "approximate")
    return Setup(nn.GELU(approximate=mode), (_k(data),), (GELU_MIN[mode][0],))


LAYER_CASES: dict[type[nn.Module], Make] = {
    nn.Linear: _linear,
    nn.Conv1d: _conv(nn.Conv1d, 1),
    nn.Conv2d: _conv(nn.Conv2d, 2),
    nn.ConvTranspose1d: _conv(nn.ConvTranspose1d, 1),
    nn.ConvTranspose2d: _conv(nn.ConvTranspose2d, 2),
    nn.BatchNorm1d: _batch_norm(nn.BatchNorm1d, 1),
    nn.BatchNorm2d: _batch_norm(nn.BatchNorm2d, 2),
    nn.BatchNorm3d: _batch_norm(nn.BatchNorm3d, 3),
    nn.Dropout: _dropout(nn.Dropout, 1),
    nn.Dropout1d: _dropout(nn.Dropout1d, 1),
    nn.Dropout2d: _dropout(nn.Dropout2d, 2),
    nn.AlphaDropout: _dropout(nn.AlphaDropout, 1),
    **{cls: _pool(cls) for cls in POOLS},
    nn.Upsample: _upsample,
    nn.ReLU: _simple(nn.ReLU, 0.0),
    nn.ReLU6: _simple(nn.ReLU6, 0.0, 6.0),
    nn.Sigmoid: _simple(nn.Sigmoid),
    nn.Tanh: _simple(nn.Tanh),
    nn.Identity: _simple(nn.Identity),
    nn.Flatten: lambda data: Setup(nn.Flatten(), (2, 3)),
    nn.Unflatten: lambda data: Setup(nn.Unflatten(1, (2, 3)), (6,)),
    nn.Hardtanh: _hardtanh,
    nn.Softplus: _softplus,
    nn.LeakyReLU: _sloped(nn.LeakyReLU),
    nn.ELU: _sloped(nn.ELU),
    nn.SiLU: _simple(nn.SiLU, SILU_MIN[0]),
    nn.GELU: _gelu,
}
"""A case for every key of :data:`defenses.civet.bounds.LAYER_RULES`."""
