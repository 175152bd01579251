r"""What a module does outside its traced graph, refused by cause before bounding.

Interval bounds follow the ``torch.fx`` graph of ``encode`` and ``decode``
(:mod:`defenses.civet.graph`). Two things a module can do are invisible there:

* **Hooks.** fx calls ``forward`` directly, so forward hooks and pre-hooks do not
  run in the graph. The old-style ``torch.nn.utils.weight_norm`` and
  ``spectral_norm`` are such pre-hooks: they recompute ``weight`` from
  ``weight_g`` / ``weight_v`` (or ``weight_orig``) before every call.
  :func:`check_hooks` refuses any module with a forward hook or pre-hook (and
  global module hooks), naming the layer and the hook; the parametrizations
  (``torch.nn.utils.parametrizations.weight_norm`` / ``spectral_norm``) compute the
  weight when it is read and are bounded.
* **State carried on the module.** A method that writes an attribute (an encoder
  feature stored on ``self`` and read by ``decode``, a call counter, a cache) makes
  ``decode`` a function of the last ``encode`` call, not of its input.
  :func:`snapshot` records every submodule's plain attributes (recursively through
  lists, tuples, dicts, sets and simple objects), and the identity and version
  counter of every parameter, buffer and tensor attribute (an in-place update bumps
  the version); :func:`changes` names what moved between two snapshots.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from defenses.civet.box import UnsupportedLayerError

_INTERNAL = frozenset(vars(nn.Module()))
"""Attributes every module has (hooks, registries, flags): not user state."""

_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
_DEPTH = 6


def _hook_name(hook: Any) -> str:
    kind = type(hook).__name__
    where = type(hook).__module__
    if where.startswith("torch.nn.utils.weight_norm"):
        return "the old-style torch.nn.utils.weight_norm hook"
    if where.startswith("torch.nn.utils.spectral_norm"):
        return "the old-style torch.nn.utils.spectral_norm hook"
    return f"a forward hook ({getattr(hook, '__qualname__', kind)})"


def check_hooks(module: nn.Module, owner: str = "model") -> None:
    """Refuse a module (or any submodule) with forward hooks, naming the layer.

    Raises
    ------
    UnsupportedLayerError
        Naming the layer, the hook and what to use instead.
    """
    for kind in _HOOKS:
        hooks = getattr(module_globals, f"_global{kind}", {})
        if hooks:
            raise UnsupportedLayerError(
                f"{owner}: a global module {kind.strip('_').replace('_', ' ')} is "
                "registered (torch.nn.modules.module.register_module_forward_hook): "
                "it changes every module's output outside the traced graph, so "
                "CIVET cannot bound it; remove it before certifying"
            )
    for name, layer in module.named_modules():
        for kind in _HOOKS:
            for hook in getattr(layer, kind, {}).values():
                what = _hook_name(hook)
                fix = (
                    "use torch.nn.utils.parametrizations."
                    + ("weight_norm" if "weight_norm" in what else "spectral_norm")
                    + " (bounded through its parametrization) instead"
                    if "old-style" in what
                    else "remove it before certifying"
                )
                raise UnsupportedLayerError(
                    f"{owner}: layer {name or '(the model itself)'!r} "
                    f"({type(layer).__name__}) carries {what}, which runs outside "
                    "the torch.fx graph CIVET bounds (the graph would bound another "
                    f"function); {fix}"
                )


def _fingerprint(value: Any, depth: int) -> Any:
    """A comparable summary of a value: exact for plain data, identity otherwise."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version, tuple(value.shape))
    if isinstance(value, float | complex):
        return repr(value)  # NaN equals itself here
    if value is None or isinstance(value, bool | int | str | bytes):
        return value
    if isinstance(value, nn.Module):
        return ("module", id(value))  # its own state is snapshotted by name
    if depth <= 0:
        return ("object", id(value))
    if isinstance(value, list | tuple):
        return (type(value).__name__, [_fingerprint(v, depth - 1) for v in value])
    if isinstance(value, set | frozenset):
        return (type(value).__name__, sorted(map(repr, value)))
    if isinstance(value, dict):
        return (
            "dict",
            [(repr(k), _fingerprint(v, depth - 1)) for k, v in value.items()],
        )
    if callable(value) or isinstance(value, type):
        return ("object", id(value))
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return (type(value).__name__, id(value), _fingerprint(attributes, depth - 1))
    return ("object", id(value), repr(value))


def _entries(module: nn.Module) -> Iterator[tuple[str, Any]]:
    for prefix, layer in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, value in vars(layer).items():
            if key not in _INTERNAL:
                yield f"{dot}{key}", value
        for key, tensor in layer._parameters.items():
            yield f"{dot}{key}", tensor
        for key, tensor in layer._buffers.items():
            yield f"{dot}{key}", tensor
        yield f"{dot}(training)", layer.training


def snapshot(module: nn.Module) -> dict[str, Any]:
    """Every attribute, parameter and buffer of every submodule, fingerprinted."""
    return {name: _fingerprint(value, _DEPTH) for name, value in _entries(module)}


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the attributes added, removed or changed between two snapshots."""
    names = sorted(set(before) | set(after))
    return [n for n in names if before.get(n, _MISSING) != after.get(n, _MISSING)]


_MISSING = object()


def check_stateless(
    module: nn.Module, before: dict[str, Any], method: str, owner: str = "model"
) -> None:
    """Refuse if calling ``method`` moved any state of ``module`` since ``before``.

    Raises
    ------
    UnsupportedLayerError
        Naming the method and the first attributes it wrote.
    """
    moved = changes(before, snapshot(module))
    if moved:
        shown = ", ".join(repr(n) for n in moved[:3])
        more = f" and {len(moved) - 3} more" if len(moved) > 3 else ""
        raise UnsupportedLayerError(
            f"{owner}.{method} writes state on the module: {shown}{more} changed "
            "during one call (in eval mode, without gradients). CIVET bounds "
            "encode and decode as functions of their inputs; state carried on "
            "self between calls (an encoder feature read by decode, a counter, a "
            "cache, a buffer updated in forward) is not in the traced graph. "
            "Return the value instead, or keep it out of the module"
        )
