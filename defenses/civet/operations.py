r"""Interval rules of the tensor functions and methods a traced graph calls.

:mod:`defenses.civet.graph` looks every ``call_function`` node up in
:data:`FUNCTIONS` (keyed by the function object) and every ``call_method`` node in
:data:`METHODS` (keyed by the method name), when one of its arguments is a
:class:`~defenses.civet.bounds.Box`:

* sums :math:`[l_1 + l_2, u_1 + u_2]`, differences :math:`[l_1 - u_2, u_1 - l_2]`,
  products with a constant of either sign, products of two boxes (the extremes of
  the four corner products), division by a constant;
* linear maps with constant weights (``F.linear``, convolutions, ``@``): centre
  :math:`Wc + b`, radius :math:`|W| r`;
* maps non-decreasing in every input, applied to both ends: the monotone
  activations, ``clamp``, pooling, linear-mode interpolation, padding, ``sum`` /
  ``mean``, and every reshape, permutation, indexing, ``cat`` and ``stack``;
* the unimodal activations (``F.silu``, ``F.gelu``, ``F.leaky_relu`` and ``F.elu``
  with a negative slope), eval-mode ``F.batch_norm`` (per-channel affine) and
  ``F.dropout`` (identity), see :mod:`defenses.civet.bounds`.

A rule raises :class:`~defenses.civet.bounds.UnsupportedLayerError` for the cases it
cannot bound soundly (a bounded weight, a bounded divisor, dropout in training mode).
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from defenses.civet.activations import GELU_MIN, SILU_MIN, sloped, softplus, unimodal
from defenses.civet.bounds import (
    LINEAR_MODES,
    Box,
    UnsupportedLayerError,
    affine,
    batch_norm_affine,
    channel_affine,
    monotone,
    pooled,
    scale_shift,
)

FunctionRule = Callable[..., Any]


def holds_box(value: Any) -> bool:
    """Whether a (nested) argument structure holds a :class:`Box`."""
    found = False

    def visit(item: Any) -> Any:
        nonlocal found
        found = found or isinstance(item, Box)
        return item

    fx.node.map_aggregate(value, visit)
    return found


def _box_first(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Box, tuple[Any, ...]]:
    box, rest = args[0], args[1:]
    if not isinstance(box, Box) or holds_box((rest, kwargs)):
        raise UnsupportedLayerError("bounds are only supported in the first argument")
    return box, rest


def _both(fn: Callable[..., torch.Tensor]) -> FunctionRule:
    """Rule of a map non-decreasing in its first argument (others constant)."""

    def rule(*args: Any, **kwargs: Any) -> Box:
        box, rest = _box_first(args, kwargs)
        return monotone(box, lambda t: fn(t, *rest, **kwargs))

    return rule


def _method(name: str) -> Callable[..., Any]:
    return lambda t, *a, **k: getattr(t, name)(*a, **k)


def _pieces(fn: Callable[..., Any]) -> FunctionRule:
    """Rule of a split (chunk, split, unbind): a tuple of boxes."""

    def rule(*args: Any, **kwargs: Any) -> tuple[Box, ...]:
        box, rest = _box_first(args, kwargs)
        lows, highs = fn(box.lower, *rest, **kwargs), fn(box.upper, *rest, **kwargs)
        return tuple(Box(a, b) for a, b in zip(lows, highs, strict=True))

    return rule


def _getitem(obj: Any, index: Any) -> Any:
    if isinstance(obj, Box):
        if holds_box(index):
            raise UnsupportedLayerError("indexing by a bounded tensor")
        return Box(obj.lower[index], obj.upper[index])
    return obj[index]


def _getattr(obj: Any, name: str, *default: Any) -> Any:
    if isinstance(obj, Box) and name in ("shape", "ndim", "dtype", "device"):
        return getattr(obj.lower, name)
    raise UnsupportedLayerError(f"attribute {name!r} of a bounded tensor")


def _join(fn: Callable[..., torch.Tensor]) -> FunctionRule:
    """Rule of ``cat`` / ``stack``: boxes and constant tensors side by side."""

    def rule(items: Any, *args: Any, **kwargs: Any) -> Box:
        boxes = [i if isinstance(i, Box) else Box(i, i) for i in items]
        return Box(
            fn([b.lower for b in boxes], *args, **kwargs),
            fn([b.upper for b in boxes], *args, **kwargs),
        )

    return rule


def _neg(a: Box) -> Box:
    return Box(-a.upper, -a.lower)


def _add(a: Any, b: Any, *, alpha: float = 1) -> Box:
    if alpha != 1:
        b = _mul(b, alpha) if isinstance(b, Box) else b * alpha
    if isinstance(a, Box) and isinstance(b, Box):
        return Box(a.lower + b.lower, a.upper + b.upper)
    if isinstance(a, Box):
        return Box(a.lower + b, a.upper + b)
    return Box(a + b.lower, a + b.upper)


def _sub(a: Any, b: Any, *, alpha: float = 1) -> Box:
    return _add(a, _neg(b) if isinstance(b, Box) else -b, alpha=alpha)


def _mul(a: Any, b: Any) -> Box:
    if isinstance(a, Box) and isinstance(b, Box):
        corners = torch.stack(
            [
                a.lower * b.lower,
                a.lower * b.upper,
                a.upper * b.lower,
                a.upper * b.upper,
            ]
        )
        return Box(corners.amin(dim=0), corners.amax(dim=0))
    box, factor = (a, b) if isinstance(a, Box) else (b, a)
    return scale_shift(box, factor, 0.0)


def _div(a: Any, b: Any) -> Box:
    if isinstance(b, Box):
        raise UnsupportedLayerError("division by a bounded tensor")
    low, high = a.lower / b, a.upper / b
    return Box(torch.minimum(low, high), torch.maximum(low, high))


def _matmul(a: Any, b: Any) -> Box:
    if isinstance(a, Box) and isinstance(b, Box):
        raise UnsupportedLayerError("product of two bounded matrices")
    if isinstance(a, Box):
        return affine(a, lambda x, w, _: x @ w, b, None)
    return affine(b, lambda x, w, _: w @ x, a, None)


def _weighted(fn: Callable[..., torch.Tensor]) -> FunctionRule:
    """Rule of ``fn(x, weight, bias, ...)``, linear in ``x`` (weights constant)."""

    def rule(x: Any, weight: Any, bias: Any = None, *rest: Any, **kwargs: Any) -> Box:
        if not isinstance(x, Box) or holds_box((weight, bias, rest, kwargs)):
            raise UnsupportedLayerError("bounded weights are not supported")
        return affine(x, lambda c, w, b: fn(c, w, b, *rest, **kwargs), weight, bias)

    return rule


def _batch_norm(
    x: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Box:
    if training or running_mean is None or running_var is None:
        raise UnsupportedLayerError(
            "batch statistics (training mode) have no sound interval rule"
        )
    scale, shift = batch_norm_affine(running_mean, running_var, weight, bias, eps)
    return channel_affine(x, scale, shift)


def _dropout(
    x: Any, p: float = 0.5, training: bool = True, inplace: bool = False
) -> Box:
    if training:
        raise UnsupportedLayerError(
            "dropout in training mode is random (F.dropout defaults to "
            "training=True; pass training=self.training, or use nn.Dropout)"
        )
    return x  # type: ignore[no-any-return]


def _interpolate(x: Any, *args: Any, **kwargs: Any) -> Box:
    mode = args[2] if len(args) > 2 else kwargs.get("mode", "nearest")
    if mode not in LINEAR_MODES:
        raise UnsupportedLayerError(
            f"interpolation mode {mode!r} has negative weights; supported: "
            f"{LINEAR_MODES}"
        )
    return _both(F.interpolate)(x, *args, **kwargs)  # type: ignore[no-any-return]


def _silu(x: Box, inplace: bool = False) -> Box:
    return unimodal(x, F.silu, *SILU_MIN)


def _gelu(x: Box, approximate: str = "none") -> Box:
    if approximate not in GELU_MIN:
        raise UnsupportedLayerError(f"GELU approximation {approximate!r}")
    return unimodal(
        x, lambda t: F.gelu(t, approximate=approximate), *GELU_MIN[approximate]
    )


def _sloped(
    fn: Callable[..., torch.Tensor], keyword: str, default: float
) -> FunctionRule:
    """LeakyReLU / ELU: monotone for a slope >= 0, else unimodal around 0."""

    def rule(x: Box, *args: Any, **kwargs: Any) -> Box:
        slope = float(args[0] if args else kwargs.get(keyword, default))
        return sloped(fn, slope)(x)

    return rule


def _softplus(x: Box, beta: float = 1.0, threshold: float = 20.0) -> Box:
    return softplus(x, beta, threshold)


def _avg_pool(fn: Callable[..., torch.Tensor], position: int) -> FunctionRule:
    """Average pooling: ``divisor_override`` (argument ``position``) may be < 0."""

    def rule(*args: Any, **kwargs: Any) -> Box:
        box, rest = _box_first(args, kwargs)
        index = position - 1
        divisor = rest[index] if len(rest) > index else kwargs.get("divisor_override")
        return pooled(box, lambda t: fn(t, *rest, **kwargs), divisor)

    return rule


SHAPE_METHODS = (
    "view",
    "reshape",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "permute",
    "transpose",
    "contiguous",
    "expand",
    "repeat",
    "t",
    "narrow",
)
_MONOTONE_METHODS = ("relu", "sigmoid", "tanh", "exp", "clamp", "clip", "sum", "mean")

FUNCTIONS: dict[Callable[..., Any], FunctionRule] = {
    operator.add: _add,
    torch.add: _add,
    operator.sub: _sub,
    torch.sub: _sub,
    operator.mul: _mul,
    torch.mul: _mul,
    operator.truediv: _div,
    torch.div: _div,
    operator.neg: _neg,
    torch.neg: _neg,
    operator.matmul: _matmul,
    torch.matmul: _matmul,
    operator.getitem: _getitem,
    builtins.getattr: _getattr,
    torch.cat: _join(torch.cat),
    torch.stack: _join(torch.stack),
    torch.chunk: _pieces(torch.chunk),
    torch.split: _pieces(torch.split),
    torch.unbind: _pieces(torch.unbind),
    F.linear: _weighted(F.linear),
    F.conv1d: _weighted(F.conv1d),
    F.conv2d: _weighted(F.conv2d),
    F.conv_transpose1d: _weighted(F.conv_transpose1d),
    F.conv_transpose2d: _weighted(F.conv_transpose2d),
    F.batch_norm: _batch_norm,
    F.dropout: _dropout,
    F.interpolate: _interpolate,
    F.silu: _silu,
    F.gelu: _gelu,
    F.leaky_relu: _sloped(F.leaky_relu, "negative_slope", 0.01),
    F.elu: _sloped(F.elu, "alpha", 1.0),
    F.softplus: _softplus,
    F.avg_pool1d: _both(F.avg_pool1d),
    F.avg_pool2d: _avg_pool(F.avg_pool2d, 6),
}
for _fn in (
    torch.relu,
    F.relu,
    torch.sigmoid,
    torch.tanh,
    torch.exp,
    torch.clamp,
    torch.clip,
    F.relu6,
    F.hardtanh,
    F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    F.pad,
    torch.sum,
    torch.mean,
    torch.flatten,
    torch.reshape,
    torch.squeeze,
    torch.unsqueeze,
    torch.permute,
    torch.transpose,
    torch.t,
):
    FUNCTIONS[_fn] = _both(_fn)

METHODS: dict[str, FunctionRule] = {
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "div": _div,
    "neg": _neg,
    "matmul": _matmul,
    "chunk": _pieces(_method("chunk")),
    "split": _pieces(_method("split")),
    "unbind": _pieces(_method("unbind")),
    "size": lambda box, *a: box.lower.size(*a),
    "dim": lambda box: box.lower.dim(),
}
for _name in (*SHAPE_METHODS, *_MONOTONE_METHODS):
    METHODS[_name] = _both(_method(_name))
