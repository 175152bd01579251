"""One sampling case per interval rule: the op, random parameters, special points.

A case draws (with hypothesis) the op's parameters, degenerate ones included, and
returns a :class:`Setup`: the op as a callable on a batch, the shape of one row and
the input values where the op changes behaviour (a threshold, a minimiser, a clamp
limit), which the sampler puts into every box that reaches them. The tables
(:data:`FUNCTION_CASES`, :data:`METHOD_CASES`, :data:`LAYER_CASES`) are keyed like
the rule registries; ``test_registry.py`` fails for a registry key without a case.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from defenses.civet.bounds import GELU_MIN, LINEAR_MODES, SILU_MIN

Op = Callable[[torch.Tensor], Any]
D = torch.float64


@dataclass(frozen=True)
class Setup:
    """An op on a batch of rows of ``shape``, and its special input values."""

    op: Op
    shape: tuple[int, ...]
    specials: tuple[float, ...] = field(default=())


Make = Callable[[st.DataObject], Setup]


def _seed(data: st.DataObject) -> torch.Generator:
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "seed"))


def _tensor(data: st.DataObject, shape: tuple[int, ...], scale: float = 1.0) -> Any:
    return scale * torch.randn(shape, generator=_seed(data), dtype=D)


def _k(data: st.DataObject, low: int = 1, high: int = 5) -> int:
    return data.draw(st.integers(low, high), "features")


SLOPES = st.sampled_from([-3.0, -1.0, -0.2, 0.0, 0.01, 0.5, 1.0, 2.5])
BETAS = st.sampled_from([1.0, 0.5, 2.0, 10.0, 1e-3, -1.0, -3.0, 100.0])
THRESHOLDS = st.sampled_from([20.0, 0.0, 1e-3, 0.5, 5.0, -2.0, -1e-3, 40.0])
LIMITS = st.sampled_from([None, -2.0, -0.5, 0.0, 0.3, 1.0, 3.0])


def elementwise(fn: Op, *specials: float) -> Make:
    return lambda data: Setup(fn, (_k(data),), specials)


def _sloped(fn: Callable[[torch.Tensor, float], torch.Tensor]) -> Make:
    def make(data: st.DataObject) -> Setup:
        slope = data.draw(SLOPES, "slope")
        return Setup(lambda x: fn(x, slope), (_k(data),), (0.0,))

    return make


def _softplus_fn(data: st.DataObject) -> Setup:
    beta, t = data.draw(BETAS, "beta"), data.draw(THRESHOLDS, "threshold")
    return Setup(lambda x: F.softplus(x, beta, t), (_k(data),), (t / beta,))


def _clamp(fn: Callable[..., torch.Tensor]) -> Make:
    def make(data: st.DataObject) -> Setup:
        low, high = data.draw(LIMITS, "min"), data.draw(LIMITS, "max")
        if low is None and high is None:
            high = 0.7
        k = _k(data)
        if data.draw(st.booleans(), "tensor limits"):
            lo = None if low is None else low + _tensor(data, (k,), 0.3)
            hi = None if high is None else high + _tensor(data, (k,), 0.3)
            return Setup(lambda x: fn(x, lo, hi), (k,), ())
        ends = tuple(v for v in (low, high) if v is not None)
        return Setup(lambda x: fn(x, low, high), (k,), ends)

    return make


def _hardtanh(data: st.DataObject) -> Setup:
    low = data.draw(st.sampled_from([-1.0, -0.2, 0.0, 0.5]), "min")
    high = low + data.draw(st.sampled_from([0.0, 1e-9, 0.3, 2.0]), "span")
    return Setup(lambda x: F.hardtanh(x, low, high), (_k(data),), (low, high))


def _gelu(data: st.DataObject) -> Setup:
    mode = data.draw(st.sampled_from(["none", "tanh"]), "approximate")
    return Setup(
        lambda x: F.gelu(x, approximate=mode), (_k(data),), (GELU_MIN[mode][0],)
    )


def _pair(fn: Callable[[Any, Any], Any], swap_ok: bool = True) -> Make:
    """``fn(a, b)`` with two bounded halves of a row, or a bounded and a constant."""

    def make(data: st.DataObject) -> Setup:
        k = _k(data)
        kind = data.draw(st.sampled_from(["boxes", "constant", "scalar", "left"]))
        const = _tensor(data, (k,))
        scalar = data.draw(st.sampled_from([-2.5, -1.0, 0.0, 0.5, 3.0]), "scalar")
        if kind == "boxes":
            return Setup(lambda x: fn(x[:, :k], x[:, k:]), (2 * k,))
        if kind == "constant":
            return Setup(lambda x: fn(x, const), (k,))
        if kind == "scalar" or not swap_ok:
            return Setup(lambda x: fn(x, scalar), (k,))
        return Setup(lambda x: fn(const, x), (k,))

    return make


def _alpha(fn: Callable[..., Any]) -> Make:
    def make(data: st.DataObject) -> Setup:
        alpha = data.draw(st.sampled_from([1.0, -2.0, 0.5, 0.0]), "alpha")
        inner = _pair(lambda a, b: fn(a, b, alpha=alpha))
        return inner(data)

    return make


def _divide(fn: Callable[[Any, Any], Any]) -> Make:
    def make(data: st.DataObject) -> Setup:
        k = _k(data)
        divisor = _tensor(data, (k,)) + data.draw(st.sampled_from([-3.0, 3.0]))
        if data.draw(st.booleans(), "scalar divisor"):
            divisor = data.draw(st.sampled_from([-4.0, -0.5, 0.25, 7.0]))
        return Setup(lambda x: fn(x, divisor), (k,))

    return make


def _matmul(fn: Callable[[Any, Any], Any], left: bool = True) -> Make:
    def make(data: st.DataObject) -> Setup:
        k, m = _k(data), _k(data)
        w = _tensor(data, (k, m))
        if left and data.draw(st.booleans(), "weight on the left"):
            v = _tensor(data, (3, 1))
            return Setup(lambda x: fn(v, x[:, None, :]), (k,))
        return Setup(lambda x: fn(x, w), (k,))

    return make


def _weighted(fn: Callable[..., torch.Tensor], dims: int, transpose: bool) -> Make:
    def make(data: st.DataObject) -> Setup:
        cin, cout = _k(data, 1, 3), _k(data, 1, 3)
        size = _k(data, 3, 5)
        kernel = _k(data, 1, 3)
        stride = data.draw(st.integers(1, 2), "stride")
        shape = (cin,) + (size,) * dims
        weight = _tensor(data, (cout, cin) + (kernel,) * dims)
        if transpose:
            weight = weight.transpose(0, 1).contiguous()
        bias = _tensor(data, (cout,)) if data.draw(st.booleans(), "bias") else None
        return Setup(lambda x: fn(x, weight, bias, stride), shape)

    return make


def _linear(data: st.DataObject) -> Setup:
    k, m = _k(data), _k(data)
    weight, bias = _tensor(data, (m, k)), _tensor(data, (m,))
    return Setup(lambda x: F.linear(x, weight, bias), (k,))


def _batch_norm(data: st.DataObject) -> Setup:
    c = _k(data)
    mean, var = _tensor(data, (c,)), _tensor(data, (c,)).abs() + 0.01
    weight, bias = _tensor(data, (c,)), _tensor(data, (c,))
    return Setup(lambda x: F.batch_norm(x, mean, var, weight, bias, False), (c, 3))


def _spatial(fn: Op, dims: int) -> Make:
    def make(data: st.DataObject) -> Setup:
        size = _k(data, 2, 5)
        return Setup(fn, (_k(data, 1, 3),) + (size,) * dims)

    return make


def _avg_pool2d(data: st.DataObject) -> Setup:
    divisor = data.draw(st.sampled_from([None, 1, 3, -1, -4]), "divisor_override")
    pad = data.draw(st.integers(0, 1), "padding")
    fn: Op = lambda x: F.avg_pool2d(  # noqa: E731
        x, 2, 1, pad, False, bool(pad), divisor
    )
    if data.draw(st.booleans(), "keyword"):
        fn = lambda x: F.avg_pool2d(x, 2, divisor_override=divisor)  # noqa: E731
    return Setup(fn, (2, 3, 4))


def _pad(data: st.DataObject) -> Setup:
    mode = data.draw(st.sampled_from(["constant", "reflect", "replicate", "circular"]))
    value = data.draw(st.sampled_from([0.0, -3.0, 2.0]), "value")
    if mode == "constant":
        return Setup(lambda x: F.pad(x, (1, 2), mode, value), (2, 4))
    return Setup(lambda x: F.pad(x, (1, 2), mode), (2, 4))


def _interpolate(data: st.DataObject) -> Setup:
    mode = data.draw(st.sampled_from(LINEAR_MODES), "mode")
    dims = {"linear": 1, "bilinear": 2, "trilinear": 3}.get(mode, 2)
    corners = (
        data.draw(st.sampled_from([None, True, False]))
        if mode in ("linear", "bilinear", "trilinear")
        else None
    )
    antialias = mode == "bilinear" and data.draw(st.booleans(), "antialias")
    scale = data.draw(st.sampled_from([0.5, 2.0, 1.5]), "scale")
    return Setup(
        lambda x: F.interpolate(
            x,
            scale_factor=scale,
            mode=mode,
            align_corners=corners,
            antialias=antialias,
        ),
        (2,) + (4,) * dims,
    )


def _dim(data: st.DataObject) -> int:
    return int(data.draw(st.sampled_from([1, 2, -1]), "dim"))


def _reduce(fn: Callable[..., Any]) -> Make:
    def make(data: st.DataObject) -> Setup:
        dim, keep = _dim(data), data.draw(st.booleans(), "keepdim")
        return Setup(lambda x: fn(x, dim, keep), (2, 3))

    return make


def _shaped(fn: Op) -> Make:
    return lambda data: Setup(fn, (2, 3))


def _split(fn: Callable[..., Any]) -> Make:
    def make(data: st.DataObject) -> Setup:
        dim = _dim(data)
        return Setup(lambda x: fn(x, 2, dim), (2, 4))

    return make


def _join(fn: Callable[..., torch.Tensor]) -> Make:
    def make(data: st.DataObject) -> Setup:
        const = _tensor(data, (1, 2, 3))
        if fn is torch.stack:
            return Setup(lambda x: fn([x, 2.0 * x, x], 1), (2, 3))
        return Setup(lambda x: fn([x, const, x], 0), (2, 3))

    return make


FUNCTION_CASES: dict[Any, Make] = {
    operator.add: _pair(operator.add, swap_ok=False),
    torch.add: _alpha(torch.add),
    operator.sub: _pair(operator.sub, swap_ok=False),
    torch.sub: _alpha(torch.sub),
    operator.mul: _pair(operator.mul, swap_ok=False),
    torch.mul: _pair(torch.mul),
    operator.truediv: _divide(operator.truediv),
    torch.div: _divide(torch.div),
    operator.neg: elementwise(operator.neg),
    torch.neg: elementwise(torch.neg),
    operator.matmul: _matmul(operator.matmul, left=False),
    torch.matmul: _matmul(torch.matmul),
    operator.getitem: _shaped(
        lambda x: x[:, 1:, ::2] + x[:, :1, [2, 0, 2, 1]][..., :2]
    ),
    getattr: _shaped(lambda x: x.reshape(x.shape[0], -1)),
    torch.cat: _join(torch.cat),
    torch.stack: _join(torch.stack),
    torch.chunk: _split(torch.chunk),
    torch.split: _split(torch.split),
    torch.unbind: _shaped(lambda x: torch.unbind(x, 1)),
    F.linear: _linear,
    F.conv1d: _weighted(F.conv1d, 1, False),
    F.conv2d: _weighted(F.conv2d, 2, False),
    F.conv_transpose1d: _weighted(F.conv_transpose1d, 1, True),
    F.conv_transpose2d: _weighted(F.conv_transpose2d, 2, True),
    F.batch_norm: _batch_norm,
    F.dropout: elementwise(lambda x: F.dropout(x, 0.5, training=False)),
    F.interpolate: _interpolate,
    F.silu: elementwise(F.silu, SILU_MIN[0]),
    F.gelu: _gelu,
    F.leaky_relu: _sloped(F.leaky_relu),
    F.elu: _sloped(F.elu),
    F.softplus: _softplus_fn,
    F.avg_pool1d: _spatial(lambda x: F.avg_pool1d(x, 2, 1, 1), 1),
    F.avg_pool2d: _avg_pool2d,
    torch.relu: elementwise(torch.relu, 0.0),
    F.relu: elementwise(F.relu, 0.0),
    torch.sigmoid: elementwise(torch.sigmoid),
    torch.tanh: elementwise(torch.tanh),
    torch.exp: elementwise(torch.exp),
    torch.clamp: _clamp(torch.clamp),
    torch.clip: _clamp(torch.clip),
    F.relu6: elementwise(F.relu6, 0.0, 6.0),
    F.hardtanh: _hardtanh,
    F.adaptive_avg_pool1d: _spatial(lambda x: F.adaptive_avg_pool1d(x, 3), 1),
    F.adaptive_avg_pool2d: _spatial(lambda x: F.adaptive_avg_pool2d(x, (2, 3)), 2),
    F.pad: _pad,
    torch.sum: _reduce(torch.sum),
    torch.mean: _reduce(torch.mean),
    torch.flatten: _shaped(lambda x: torch.flatten(x, 1)),
    torch.reshape: _shaped(lambda x: torch.reshape(x, (-1, 3, 2))),
    torch.squeeze: _shaped(lambda x: torch.squeeze(x[:, :1], 1)),
    torch.unsqueeze: _shaped(lambda x: torch.unsqueeze(x, 2)),
    torch.permute: _shaped(lambda x: torch.permute(x, (0, 2, 1))),
    torch.transpose: _shaped(lambda x: torch.transpose(x, 1, 2)),
    torch.t: _shaped(lambda x: torch.t(x.flatten(1))),
}
"""A case for every key of :data:`defenses.civet.operations.FUNCTIONS`."""


def _method(name: str, *args: Any, **kwargs: Any) -> Op:
    return lambda x: getattr(x, name)(*args, **kwargs)


def _method_clamp(name: str) -> Make:
    return _clamp(lambda x, lo, hi: getattr(x, name)(lo, hi))


METHOD_CASES: dict[str, Make] = {
    "add": _pair(lambda a, b: a.add(b)),
    "sub": _pair(lambda a, b: a.sub(b), swap_ok=False),
    "mul": _pair(lambda a, b: a.mul(b), swap_ok=False),
    "div": _divide(lambda a, b: a.div(b)),
    "neg": elementwise(_method("neg")),
    "matmul": _matmul(lambda a, b: a.matmul(b)),
    "chunk": _split(lambda x, n, d: x.chunk(n, d)),
    "split": _split(lambda x, n, d: x.split(n, d)),
    "unbind": _shaped(lambda x: x.unbind(2)),
    "size": _shaped(lambda x: x.view(x.size(0), -1)),
    "dim": _shaped(lambda x: x.sum(x.dim() - 1)),
    "view": _shaped(lambda x: x.view(-1, 6)),
    "reshape": _shaped(lambda x: x.reshape(-1, 3, 2)),
    "flatten": _shaped(lambda x: x.flatten(1)),
    "unflatten": _shaped(_method("unflatten", 2, (3, 1))),
    "squeeze": _shaped(lambda x: x[:, :1].squeeze(1)),
    "unsqueeze": _shaped(lambda x: x.unsqueeze(1)),
    "permute": _shaped(lambda x: x.permute(0, 2, 1)),
    "transpose": _shaped(lambda x: x.transpose(1, 2)),
    "contiguous": _shaped(lambda x: x.transpose(1, 2).contiguous()),
    "expand": _shaped(lambda x: x[:, None].expand(-1, 3, 2, 3)),
    "repeat": _shaped(lambda x: x.repeat(1, 2, 1)),
    "t": _shaped(lambda x: x.flatten(1).t()),
    "narrow": _shaped(lambda x: x.narrow(2, 1, 2)),
    "relu": elementwise(_method("relu"), 0.0),
    "sigmoid": elementwise(_method("sigmoid")),
    "tanh": elementwise(_method("tanh")),
    "exp": elementwise(_method("exp")),
    "clamp": _method_clamp("clamp"),
    "clip": _method_clamp("clip"),
    "sum": _reduce(lambda x, d, k: x.sum(d, keepdim=k)),
    "mean": _reduce(lambda x, d, k: x.mean(d, keepdim=k)),
}
"""A case for every key of :data:`defenses.civet.operations.METHODS`."""
