r"""Interval bounds through a module's traced graph (``torch.fx``).

A module's method (``forward``, or a VAE's ``encode`` / ``decode``) is traced once
with :mod:`torch.fx` into a graph of layer calls, tensor functions and tensor
methods; :func:`propagate` then walks that graph with a :class:`~defenses.civet.
bounds.Box` in place of each input. Residual additions, concatenations, splits,
reshapes and flattening are therefore bounded exactly as the module computes them,
not only chains of :class:`torch.nn.Sequential`.

Every node that receives a box needs a sound rule: leaf layers (``torch.nn``
modules) use :func:`defenses.civet.bounds.layer_rule`, tensor functions and methods
the tables of :mod:`defenses.civet.operations`. Nodes that see no box (shapes,
parameters, constants) are evaluated as they are. A node without a rule raises
:class:`~defenses.civet.bounds.UnsupportedLayerError` naming it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from defenses.civet.aliases import (
    PREFIX,
    check_in_place,
    describe,
    in_place,
    without_inplace,
)
from defenses.civet.bounds import Box, UnsupportedLayerError, layer_rule, out_of_place
from defenses.civet.operations import FUNCTIONS, METHODS, SHAPE_METHODS, holds_box
from defenses.civet.state import check_hooks


class PropagationError(UnsupportedLayerError):
    """An operation raised while bounds were propagated through it (named)."""


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
        traced = fx.GraphModule(root, graph)
    except Exception as error:
        raise TypeError(
            f"{owner}.{method} could not be traced by torch.fx "
            f"({type(error).__name__}: {error}); interval bounds need a method "
            "without control flow on tensor values"
        ) from error
    if root is not module:  # layers are named as the user's module names them
        traced.meta[PREFIX] = "module."
    return traced


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
        try:
            env[node] = _step(graph, node, env)
        except PropagationError:
            raise
        except UnsupportedLayerError as error:
            if str(error).startswith(("interval bound propagation", "layer ")):
                raise
            raise UnsupportedLayerError(
                f"interval bound propagation has no sound rule for "
                f"{describe(node, graph)}: {error}"
            ) from error
    raise UnsupportedLayerError("the traced graph has no output")


def _step(graph: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """One node's value (a box if it depends on one); other errors are named."""
    try:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if not holds_box((args, kwargs)):
            return _concrete(graph, node, args, kwargs)
        return _bound(graph, node, args, kwargs)
    except UnsupportedLayerError:
        raise
    except Exception as error:
        raise PropagationError(
            f"interval bound propagation failed at {describe(node, graph)}: "
            f"{type(error).__name__}: {error}; CIVET cannot bound this module"
        ) from error


def _concrete(graph: fx.GraphModule, node: fx.Node, args: Any, kwargs: Any) -> Any:
    if node.op == "call_module":
        return graph.get_submodule(str(node.target))(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    return node.target(*args, **kwargs)  # type: ignore[operator]


def _bound(graph: fx.GraphModule, node: fx.Node, args: Any, kwargs: Any) -> Any:
    if in_place(graph, node):
        check_in_place(graph, node)
        args, kwargs = without_inplace(node, args, kwargs)
    if node.op == "call_module":
        layer = graph.get_submodule(str(node.target))
        if len(args) != 1 or kwargs or not isinstance(args[0], Box):
            raise UnsupportedLayerError(
                f"{describe(node, graph)} is called with several inputs"
            )
        try:
            layer_bound = layer_rule(out_of_place(layer))
        except UnsupportedLayerError as error:
            name = str(node.target).removeprefix(graph.meta.get(PREFIX, "\0"))
            raise UnsupportedLayerError(f"layer {name!r}: {error}") from error
        return layer_bound(args[0])
    if node.op == "call_method":
        rule = METHODS.get(str(node.target))
    else:
        rule = FUNCTIONS.get(node.target)  # type: ignore[arg-type]
    if rule is None:
        raise UnsupportedLayerError(
            f"interval bound propagation has no sound rule for {describe(node, graph)}"
        )
    return rule(*args, **kwargs)


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
            (node.op == "call_method" and node.target in SHAPE_METHODS)
            or node.target in (torch.flatten, torch.reshape)
        ):
            return None
        node = node.args[0]
    return None


def parameter_dtype(module: nn.Module) -> torch.dtype:
    """Dtype of the first floating-point parameter (the default dtype if none)."""
    for parameter in module.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.get_default_dtype()


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
    TypeError
        If ``box`` is not of floating-point tensors in the module's dtype.
    ValueError
        If ``box`` is malformed (see :meth:`Box.validate`) or its shape does not
        fit the module.
    UnsupportedLayerError
        If an operation has no sound rule here (e.g. LayerNorm, BatchNorm or
        Dropout in training mode), or a layer carries a forward hook (which the
        rules would not see); the message names it.
    """
    box = box.validate()
    check_hooks(module, type(module).__name__)
    dtype = parameter_dtype(module)
    if any(True for _ in module.parameters()) and box.lower.dtype != dtype:
        raise TypeError(
            f"box dtype {box.lower.dtype} does not match the module's parameters "
            f"({dtype}); cast one of them"
        )
    try:
        out = _forward(module, box)
    except PropagationError as error:
        if not isinstance(error.__cause__, RuntimeError):
            raise
        raise ValueError(
            f"box of shape {tuple(box.lower.shape)} does not fit "
            f"{type(module).__name__}: {error.__cause__}"
        ) from error
    except RuntimeError as error:
        raise ValueError(
            f"box of shape {tuple(box.lower.shape)} does not fit "
            f"{type(module).__name__}: {error}"
        ) from error
    if not isinstance(out, Box):
        raise UnsupportedLayerError(
            f"{type(module).__name__}.forward must return one tensor, got "
            f"{type(out).__name__}"
        )
    return out


def _forward(module: nn.Module, box: Box) -> Any:
    if type(module) is nn.Sequential:
        for layer in module:
            box = _forward(layer, box)
        return box
    if type(module).__module__.startswith("torch.nn"):
        return layer_rule(out_of_place(module))(box)
    return propagate(trace(module), box)
