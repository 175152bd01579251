r"""Interval bounds through a module's traced graph (``torch.fx``).

A module's method (``forward``, or a VAE's ``encode`` / ``decode``) is traced once
with :mod:`torch.fx` into a graph of layer calls, tensor functions and tensor
methods; :func:`propagate` then walks that graph with a :class:`~defenses.civet.
bounds.Box` in place of each input. Residual additions, concatenations, splits,
reshapes and flattening are therefore bounded exactly as the module computes them,
not only chains of :class:`torch.nn.Sequential`.

Every node that receives a box needs a sound rule:

* leaf layers (``torch.nn`` modules): :func:`defenses.civet.bounds.layer_rule`;
* sums :math:`[l_1 + l_2, u_1 + u_2]`, differences :math:`[l_1 - u_2, u_1 - l_2]`,
  products with a constant (either sign) or of two boxes (the extremes of the four
  corner products), division by a constant;
* constant-weight linear maps (``F.linear``, convolutions, ``@``): centre
  :math:`Wc + b`, radius :math:`|W| r`;
* maps non-decreasing in every input, applied to both ends: the monotone
  activations, ``clamp``, pooling, linear-mode interpolation, padding, ``sum`` /
  ``mean``, and every reshape, permutation, indexing, ``cat`` and ``stack``;
* the unimodal activations (``F.silu``, ``F.gelu``, ``F.leaky_relu`` and ``F.elu``
  with negative slopes) and eval-mode ``F.batch_norm`` / ``F.dropout``.

Nodes that see no box (shapes, parameters, constants) are evaluated as they are. A
node without a rule raises :class:`~defenses.civet.bounds.UnsupportedLayerError`
naming it.
"""

from __future__ import annotations

import builtins
import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from defenses.civet.bounds import (
    GELU_MIN,
    LINEAR_MODES,
    SILU_MIN,
    Box,
    UnsupportedLayerError,
    affine,
    batch_norm_affine,
    channel_affine,
    layer_rule,
    monotone,
    scale_shift,
    unimodal,
)

FunctionRule = Callable[..., Any]


class _Method(nn.Module):
    """``module.<method>(x)`` as a module, so that fx can trace any method."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self.module = module
        self.method = method

    def forward(self, x: torch.Tensor) -> Any:
        return getattr(self.module, self.method)(x)


def trace(
    module: nn.Module, method: str = "forward", owner: str = "model"
) -> fx.GraphModule:
    """The fx graph of ``module.<method>(x)`` (traced with the module's current mode).

    Raises
    ------
    TypeError
        If fx cannot trace the method (e.g. control flow that depends on tensor
        values); the message names ``owner.method``.
    """
    root = module if method == "forward" else _Method(module, method)
    try:
        graph = fx.Tracer().trace(root)
    except Exception as error:
        raise TypeError(
            f"{owner}.{method} could not be traced by torch.fx ({error}); interval "
            "bounds need a method without control flow on tensor values"
        ) from error
    return fx.GraphModule(root, graph)


def _holds_box(value: Any) -> bool:
    found = False

    def visit(item: Any) -> Any:
        nonlocal found
        found = found or isinstance(item, Box)
        return item

    fx.node.map_aggregate(value, visit)
    return found


def _describe(node: fx.Node, graph: fx.GraphModule) -> str:
    if node.op == "call_module":
        layer = graph.get_submodule(str(node.target))
        return f"layer {node.target!r} ({type(layer).__name__})"
    if node.op == "call_method":
        return f"tensor method .{node.target}()"
    name = getattr(node.target, "__name__", repr(node.target))
    return f"function {name}()"


def propagate(graph: fx.GraphModule, *inputs: Any) -> Any:
    """Run ``graph`` with boxes (or tensors) as inputs; boxes flow through rules.

    Returns whatever the traced method returns, with a :class:`Box` for every
    tensor that depended on a box input.
    """
    env: dict[fx.Node, Any] = {}
    feed = iter(inputs)
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(feed, node.args[0] if node.args else None)
            continue
        if node.op == "output":
            return fx.node.map_arg(node.args[0], env.__getitem__)
        if node.op == "get_attr":
            target = str(node.target)
            env[node] = functools.reduce(getattr, target.split("."), graph)
            continue
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if not _holds_box((args, kwargs)):
            env[node] = _concrete(graph, node, args, kwargs)
            continue
        try:
            env[node] = _bound(graph, node, args, kwargs)
        except UnsupportedLayerError as error:
            if str(error).startswith("interval bound propagation"):
                raise
            raise UnsupportedLayerError(
                f"interval bound propagation has no sound rule for "
                f"{_describe(node, graph)}: {error}"
            ) from error
    raise UnsupportedLayerError("the traced graph has no output")


def _concrete(graph: fx.GraphModule, node: fx.Node, args: Any, kwargs: Any) -> Any:
    if node.op == "call_module":
        return graph.get_submodule(str(node.target))(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    return node.target(*args, **kwargs)  # type: ignore[operator]


def _bound(graph: fx.GraphModule, node: fx.Node, args: Any, kwargs: Any) -> Any:
    if node.op == "call_module":
        layer = graph.get_submodule(str(node.target))
        if len(args) != 1 or kwargs or not isinstance(args[0], Box):
            raise UnsupportedLayerError(
                f"{_describe(node, graph)} is called with several inputs"
            )
        return layer_rule(layer)(args[0])
    if node.op == "call_method":
        rule = METHODS.get(str(node.target))
    else:
        rule = FUNCTIONS.get(node.target)  # type: ignore[arg-type]
    if rule is None:
        raise UnsupportedLayerError(
            f"interval bound propagation has no sound rule for {_describe(node, graph)}"
        )
    return rule(*args, **kwargs)


def _box_first(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Box, tuple[Any, ...]]:
    box, rest = args[0], args[1:]
    if not isinstance(box, Box) or _holds_box((rest, kwargs)):
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
        if _holds_box(index):
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
        b = _mul(b, alpha)
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
        if not isinstance(x, Box) or _holds_box((weight, bias, rest, kwargs)):
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
        raise UnsupportedLayerError("dropout in training mode is random")
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


def _sloped(fn: Callable[..., torch.Tensor], default: float) -> FunctionRule:
    """LeakyReLU / ELU: monotone for a slope >= 0, else unimodal around 0."""

    def rule(x: Box, slope: float = default, inplace: bool = False) -> Box:
        if slope >= 0:
            return monotone(x, lambda t: fn(t, slope))
        return unimodal(x, lambda t: fn(t, slope), 0.0, 0.0)

    return rule


_SHAPE_METHODS = (
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
    F.leaky_relu: _sloped(F.leaky_relu, 0.01),
    F.elu: _sloped(F.elu, 1.0),
}
for _fn in (
    torch.relu,
    F.relu,
    torch.sigmoid,
    F.sigmoid,
    torch.tanh,
    F.tanh,
    torch.exp,
    torch.clamp,
    torch.clip,
    F.softplus,
    F.relu6,
    F.hardtanh,
    F.avg_pool1d,
    F.avg_pool2d,
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
for _name in (*_SHAPE_METHODS, *_MONOTONE_METHODS):
    METHODS[_name] = _both(_method(_name))

_BOUNDED_OUTPUT: dict[Any, tuple[float, float]] = {
    torch.sigmoid: (0.0, 1.0),
    F.sigmoid: (0.0, 1.0),
    "sigmoid": (0.0, 1.0),
    torch.tanh: (-1.0, 1.0),
    F.tanh: (-1.0, 1.0),
    "tanh": (-1.0, 1.0),
}
_PASS_THROUGH = (nn.Flatten, nn.Unflatten, nn.Identity)


def output_range(graph: fx.GraphModule) -> tuple[float, float] | None:
    """Range of every output of ``graph`` if its last map is bounded, else None.

    Walks back from the output through reshapes to a Sigmoid (0, 1), Tanh
    (-1, 1) or Hardtanh (its clip values).
    """
    (output,) = (n for n in graph.graph.nodes if n.op == "output")
    node = output.args[0]
    while isinstance(node, fx.Node):
        if node.op == "call_module":
            layer = graph.get_submodule(str(node.target))
            if isinstance(layer, nn.Sigmoid):
                return (0.0, 1.0)
            if isinstance(layer, nn.Tanh):
                return (-1.0, 1.0)
            if isinstance(layer, nn.Hardtanh):
                return (float(layer.min_val), float(layer.max_val))
            if not isinstance(layer, _PASS_THROUGH):
                return None
        elif node.target in _BOUNDED_OUTPUT:
            return _BOUNDED_OUTPUT[node.target]
        elif not (
            (node.op == "call_method" and node.target in _SHAPE_METHODS)
            or node.target in (torch.flatten, torch.reshape)
        ):
            return None
        node = node.args[0]
    return None


def ibp(module: nn.Module, box: Box) -> Box:
    """Propagate ``box`` through ``module``: a sound, differentiable output box.

    Parameters
    ----------
    module : torch.nn.Module
        Any module whose ``forward(x)`` fx can trace and whose every operation on
        ``x`` has a rule (see the module docstring); a ``torch.nn`` layer or an
        :class:`torch.nn.Sequential` of them is bounded without tracing.
    box : Box
        Input box with a leading batch dimension.

    Returns
    -------
    Box
        For every input ``x`` in ``box``, ``module(x)`` lies in the returned box
        (up to floating-point rounding).

    Raises
    ------
    ValueError
        If ``box`` is malformed (see :meth:`Box.validate`).
    UnsupportedLayerError
        If an operation has no sound rule here (e.g. LayerNorm, BatchNorm or
        Dropout in training mode); the message names it.
    """
    out = _forward(module, box.validate())
    if not isinstance(out, Box):
        raise UnsupportedLayerError(
            f"{type(module).__name__}.forward must return one tensor, got "
            f"{type(out).__name__}"
        )
    return out


def _forward(module: nn.Module, box: Box) -> Any:
    if isinstance(module, nn.Sequential):
        for layer in module:
            box = _forward(layer, box)
        return box
    if type(module).__module__.startswith("torch.nn"):
        return layer_rule(module)(box)
    return propagate(trace(module), box)
