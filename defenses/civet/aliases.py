r"""Which in-place operations of a traced graph can be bounded out of place.

Interval propagation (:mod:`defenses.civet.graph`) bounds an in-place activation
(``nn.ReLU(inplace=True)``, ``F.relu(h, inplace=True)``) by its out-of-place
version. The two compute the same values only if no other reader of the
overwritten *storage* runs after the operation: an in-place op on a view, a slice
or any other alias of a tensor overwrites that tensor too (``F.relu(h[:, :32],
inplace=True)`` changes ``h``; ``relu(h.view(-1, 8, 8), inplace=True)`` changes every
entry of ``h``).

:func:`check_in_place` therefore works on storage, not on graph nodes. For the
in-place node :math:`N` it

1. walks up from :math:`N`'s input through every node that may return an alias of
   its first argument (views, slices, reshapes, splits, ``contiguous``, identity
   layers, eval-mode dropout, other in-place ops, and every operation not known to
   return a fresh tensor) to the *roots* that own the storage;
2. collects the alias set :math:`A`: the roots and every node reachable from them
   through such alias edges, and :math:`D \subseteq A`: :math:`N` and the aliases
   derived from its result (they see the new values under both semantics);
3. refuses if a node outside :math:`A` that runs after :math:`N` (the output
   included) reads a member of :math:`A \setminus D`, or if a root is the method's
   input (the caller's tensor, which the loss reads again) or a parameter or buffer.

The rule is conservative: an alias it cannot rule out counts as an alias, so an
in-place op on disjoint slices read later is refused too (``inplace=False`` always
works). The certificate's own cross-check (:mod:`defenses.civet.crosscheck`)
compares the propagated point bounds with the module at the centre and catches
any remaining disagreement.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from defenses.civet.bounds import POOLS, UnsupportedLayerError

INPLACE_POSITION: dict[Any, int] = {
    F.relu: 1,
    F.relu6: 1,
    F.silu: 1,
    F.elu: 2,
    F.leaky_relu: 2,
    F.hardtanh: 3,
    F.dropout: 3,
}
"""Positional index of the ``inplace`` parameter of the functions that have one."""

_FRESH_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.modules.batchnorm._BatchNorm,
    nn.ReLU,
    nn.ReLU6,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
    nn.Hardtanh,
    nn.SiLU,
    nn.GELU,
    nn.LeakyReLU,
    nn.ELU,
    nn.Upsample,
    *POOLS,
)
"""Leaf layers that return a new tensor (when they do not work in place)."""

_FRESH_FUNCTIONS: frozenset[Any] = frozenset(
    {
        operator.add,
        operator.sub,
        operator.mul,
        operator.truediv,
        operator.neg,
        operator.matmul,
        getattr,
        torch.add,
        torch.sub,
        torch.mul,
        torch.div,
        torch.neg,
        torch.matmul,
        torch.cat,
        torch.stack,
        torch.relu,
        torch.sigmoid,
        torch.tanh,
        torch.exp,
        torch.clamp,
        torch.clip,
        torch.sum,
        torch.mean,
        F.linear,
        F.conv1d,
        F.conv2d,
        F.conv_transpose1d,
        F.conv_transpose2d,
        F.batch_norm,
        F.interpolate,
        F.gelu,
        F.sigmoid,
        F.tanh,
        F.softplus,
        F.pad,
        F.avg_pool1d,
        F.avg_pool2d,
        F.adaptive_avg_pool1d,
        F.adaptive_avg_pool2d,
        *(f for f in INPLACE_POSITION if f is not F.dropout),
    }
)
"""Functions that return a new tensor (when they do not work in place)."""

_FRESH_METHODS = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "matmul",
        "relu",
        "sigmoid",
        "tanh",
        "exp",
        "clamp",
        "clip",
        "sum",
        "mean",
        "repeat",
        "size",
        "dim",
    }
)


def in_place(graph: fx.GraphModule, node: fx.Node) -> bool:
    """Whether the node overwrites its input (``inplace=True``, a trailing ``_``)."""
    if node.op == "call_module":
        return bool(getattr(graph.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_")
    if node.op != "call_function":
        return False
    if node.kwargs.get("inplace") is True:
        return True
    position = INPLACE_POSITION.get(node.target)
    if position is not None:
        return len(node.args) > position and node.args[position] is True
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def without_inplace(node: fx.Node, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The arguments of ``node``'s out-of-place call (its ``inplace`` flag dropped)."""
    if "inplace" in kwargs:
        return args, {k: v for k, v in kwargs.items() if k != "inplace"}
    position = INPLACE_POSITION.get(node.target)
    if node.op == "call_function" and position is not None and len(args) > position:
        return (*args[:position], *args[position + 1 :]), kwargs
    return args, kwargs


def _aliases(graph: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node``'s result may share storage with its first argument."""
    if in_place(graph, node):
        return True
    if node.op == "call_module":
        layer = graph.get_submodule(str(node.target))
        return not isinstance(layer, _FRESH_LAYERS)
    if node.op == "call_method":
        return str(node.target) not in _FRESH_METHODS
    if node.op == "call_function":
        return node.target not in _FRESH_FUNCTIONS
    return False


def _source(node: fx.Node) -> fx.Node | None:
    first = node.args[0] if node.args else None
    return first if isinstance(first, fx.Node) else None


def _closure(graph: fx.GraphModule, start: set[fx.Node]) -> set[fx.Node]:
    """``start`` and every node reachable from it through alias edges."""
    found, stack = set(start), list(start)
    while stack:
        for user in stack.pop().users:
            if user not in found and _aliases(graph, user) and _source(user) in found:
                found.add(user)
                stack.append(user)
    return found


PREFIX = "civet_prefix"
"""Key of ``GraphModule.meta`` holding the prefix the tracing wrapper adds to names."""


def describe(node: fx.Node, graph: fx.GraphModule) -> str:
    """A node as the messages name it: a layer, a tensor method or a function."""
    if node.op in ("call_module", "get_attr"):
        name = str(node.target).removeprefix(graph.meta.get(PREFIX, "\0"))
    if node.op == "call_module":
        layer = graph.get_submodule(str(node.target))
        return f"layer {name!r} ({type(layer).__name__})"
    if node.op == "call_method":
        return f"tensor method .{node.target}()"
    if node.op == "placeholder":
        return f"the input {node.target!r}"
    if node.op == "get_attr":
        return f"parameter or buffer {name!r}"
    if node.op == "output":
        return "the method's output"
    name = getattr(node.target, "__name__", repr(node.target))
    return f"function {name}()"


def check_in_place(graph: fx.GraphModule, node: fx.Node) -> None:
    """Raise :class:`UnsupportedLayerError` unless ``node`` can run out of place.

    See the module docstring for the rule; the message names the in-place
    operation, the tensor whose storage it overwrites and the reader that would
    see the overwritten values.
    """
    source = _source(node)
    if source is None:
        return
    roots: set[fx.Node] = set()
    stack, seen = [source], {source}
    while stack:
        current = stack.pop()
        parent = _source(current) if _aliases(graph, current) else None
        if parent is None:
            roots.add(current)
        elif parent not in seen:
            seen.add(parent)
            stack.append(parent)
    what = (
        "interval bound propagation cannot bound "
        f"{describe(node, graph)} out of place: it"
    )
    for root in roots:
        if root.op in ("placeholder", "get_attr"):
            raise UnsupportedLayerError(
                f"{what} works in place on {describe(root, graph)} (or a view of "
                "it), which its caller reads again; use inplace=False"
            )
    family = _closure(graph, roots)
    mine = _closure(graph, {node})
    order = {n: i for i, n in enumerate(graph.graph.nodes)}
    for member in sorted(family - mine, key=order.__getitem__):
        for reader in member.users:
            if reader not in family and order[reader] > order[node]:
                owner = min(roots, key=order.__getitem__)
                view = "" if member is owner else f" through {describe(member, graph)}"
                raise UnsupportedLayerError(
                    f"{what} works in place on a view or alias of the output of "
                    f"{describe(owner, graph)}, which {describe(reader, graph)} "
                    f"reads again afterwards{view}: it would see the overwritten "
                    "values; use inplace=False"
                )
