"""What the source model computes, read from its installed modules, not its config.

:func:`check_installed` refuses, naming the module and the cause, every way a
module can compute something other than what its class says:

* a module that is not one of ``transformers``' own BERT classes or a ``torch.nn``
  leaf (a same-named subclass included);
* hooks: the module's own forward (pre-)hooks, and the global ones
  (``torch.nn.modules.module.register_module_forward_hook`` and
  ``register_module_forward_pre_hook``), which run on every module;
* replaced code: an instance attribute that shadows a method of its class, and any
  method of any class in the module's MRO (a class-level patch such as
  ``BertIntermediate.forward = f``), or any function stored on the instance, whose
  code (through ``__wrapped__`` chains and closures) does not live in ``torch``'s or
  ``transformers``' own installed files;
* attention: the function ``transformers``' attention registry
  (``AttentionInterface``) returns for the module's ``_attn_implementation`` must be
  the library's own for that name; a causal module or a changed score ``scaling``
  is refused;
* activations: each block's installed ``intermediate_act_fn`` must be a known GELU
  or ReLU class (whatever ``config.hidden_act`` says), the pooler's ``nn.Tanh``;
* LayerNorms: normalised over the width, one epsilon for all (read from the
  modules), affine or not.

What no static rule sees (a swapped function attribute, a patched ``torch``
function) is caught by the numerical self-check in
:mod:`~crypto.conversion.selfcheck`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
import os
import sys
from typing import Any

import torch
from torch import nn

from .errors import ConversionError
from .functions import Activation, SourceFunctions, read_activation

BLOCKS = (
    "Embeddings",
    "Encoder",
    "Layer",
    "Attention",
    "SelfAttention",
    "SelfOutput",
    "Intermediate",
    "Output",
)
KNOWN = {
    *(f"{family}{block}" for family in ("Bert", "Roberta") for block in BLOCKS),
    "RobertaForSequenceClassification",
    "RobertaModel",
    "RobertaClassificationHead",
    "BertForSequenceClassification",
    "BertModel",
    "BertSdpaSelfAttention",
    "BertPooler",
    "Embedding",
    "LayerNorm",
    "Dropout",
    "Linear",
    "ModuleList",
    "Tanh",
    "ReLU",
    "GELU",
    "GELUActivation",
    "NewGELUActivation",
    "FastGELUActivation",
    "QuickGELUActivation",
    "AccurateGELUActivation",
    "GELUTanh",
    "PytorchGELUTanh",
}
HOMES = (
    "transformers.models.bert.",
    "transformers.models.roberta.",
    "transformers.activations",
    "torch.nn.",
)
"""A known layer must also be the library's own class (not a same-named subclass)."""
HOOKS = ("_forward_hooks", "_forward_pre_hooks")
"""A module with one of these hooks computes something else than its class says."""
GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")
ATTENTION = {
    "sdpa": ("transformers.integrations.sdpa_attention", "sdpa_attention_forward"),
    "flash_attention_2": (
        "transformers.integrations.flash_attention",
        "flash_attention_forward",
    ),
    "flash_attention_3": (
        "transformers.integrations.flash_attention",
        "flash_attention_forward",
    ),
}
"""The library's own function of each non-eager attention name (softmax attention)."""


def _where(name: str) -> str:
    return name or "<root>"


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """The folders of ``torch``, ``transformers``, the standard library, ``kernels``.

    ``transformers`` decorates its activation classes with ``kernels``' hub-kernel
    methods when that package is installed.
    """
    import transformers

    homes = [torch, transformers, os]
    with contextlib.suppress(ImportError):  # optional
        homes.append(importlib.import_module("kernels"))
    return tuple(
        os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in homes
    )


def foreign_code(value: object, depth: int = 0) -> str | None:
    """Where ``value``'s code lives, if outside ``torch``, ``transformers`` and stdlib.

    Follows static and class methods, properties, ``functools.partial``, bound
    methods, ``__wrapped__`` chains and functions captured in closures; None for
    library code and for values that are not functions.
    """
    if depth > 8:
        return None
    parts: list[object] = []
    if isinstance(value, (staticmethod, classmethod)):
        parts.append(value.__func__)
    elif isinstance(value, property):
        parts += [value.fget, value.fset]
    elif isinstance(value, functools.partial):
        parts.append(value.func)
    elif inspect.ismethod(value):
        parts.append(value.__func__)
    elif inspect.isfunction(value):
        code = value.__code__
        path = os.path.abspath(code.co_filename)
        if not path.startswith(_library_dirs()):
            return f"{code.co_filename}:{code.co_firstlineno}"
        parts.append(getattr(value, "__wrapped__", None))
        for cell in value.__closure__ or ():
            try:
                parts.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    for part in parts:
        found = foreign_code(part, depth + 1) if part is not None else None
        if found:
            return found
    return None


def check_global_hooks() -> None:
    """Refuse while a global forward (pre-)hook or a ``torch`` mode is active.

    A ``TorchFunctionMode`` or ``TorchDispatchMode`` sees (and may change) every
    ``torch`` operation, the source's included.
    """
    from torch.nn.modules import module as registry

    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        raise ConversionError(
            "cannot convert inside a torch function or dispatch mode "
            "(torch.overrides.TorchFunctionMode, TorchDispatchMode): it may change "
            "every operation the source runs; convert outside it"
        )

    for attr in GLOBAL_HOOKS:
        if getattr(registry, attr, None):
            kind = "pre-hook" if "pre" in attr else "hook"
            raise ConversionError(
                f"cannot convert while a global forward {kind} is registered "
                f"(torch.nn.modules.module.{attr}, from register_module_forward_"
                f"{'pre_' if 'pre' in attr else ''}hook): it runs on every module, "
                "so no module computes what its class says; remove it "
                "(handle.remove()) before converting"
            )


def _check_code(name: str, module: nn.Module) -> None:
    kind = type(module)
    for attr, value in vars(module).items():
        shadows = hasattr(kind, attr) and not isinstance(value, (torch.Tensor, bool))
        if attr == "forward" or (shadows and callable(value)):
            raise ConversionError(
                f"cannot convert layer {_where(name)!r}: its {attr} is replaced on the "
                f"instance, so it does not compute what {kind.__name__} computes"
            )
        where = foreign_code(value) if callable(value) else None
        if where:
            raise ConversionError(
                f"cannot convert layer {_where(name)!r}: its attribute {attr!r} is "
                f"code from {where}, not from torch or transformers"
            )
    for cls in kind.__mro__:
        if cls is object:
            continue
        for attr, value in vars(cls).items():
            where = foreign_code(value)
            if where:
                raise ConversionError(
                    f"cannot convert layer {_where(name)!r}: "
                    f"{cls.__module__}.{cls.__qualname__}.{attr} is patched (its "
                    f"code is from {where}, not from torch or transformers)"
                )


def check_module(name: str, module: nn.Module) -> None:
    """Refuse an unknown class, a hook or replaced code on one module (see module)."""
    kind = type(module).__name__
    home = type(module).__module__
    if kind not in KNOWN or not home.startswith(HOMES):
        raise ConversionError(
            f"cannot convert layer {_where(name)!r} of type {home}.{kind}: the "
            "converter knows only BERT's embeddings, self-attention, "
            "feed-forward, pooler and classifier"
        )
    if isinstance(module, nn.Embedding) and module.max_norm is not None:
        raise ConversionError(
            f"cannot convert layer {_where(name)!r}: nn.Embedding with max_norm="
            f"{module.max_norm} renormalises its rows in place at every lookup"
        )
    hooks = [h for h in HOOKS if getattr(module, h, None)]
    if "forward" in vars(module) or hooks:
        changed = "its forward is replaced" if not hooks else f"it has {hooks[0]}"
        raise ConversionError(
            f"cannot convert layer {_where(name)!r}: {changed}, so it does "
            f"not compute what {kind} computes"
        )
    _check_code(name, module)


def check_attention(name: str, module: nn.Module, head_dim: int) -> None:
    """The registered attention of a self-attention module must be the library's."""
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if getattr(module, "is_causal", False) or getattr(module, "is_decoder", False):
        raise ConversionError(
            f"cannot convert layer {name!r}: it is causal (a decoder's attention)"
        )
    scaling = float(getattr(module, "scaling", head_dim**-0.5))
    if not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-12):
        raise ConversionError(
            f"cannot convert layer {name!r}: its score scaling is {scaling!r}, not "
            f"1/sqrt(d_h) = {head_dim**-0.5!r}"
        )
    home = sys.modules[type(module).__module__]
    eager = getattr(home, "eager_attention_forward", None)
    if impl in (None, "eager"):
        function, want = eager, (home.__name__, "eager_attention_forward")
    elif impl in ATTENTION:
        registry = getattr(home, "ALL_ATTENTION_FUNCTIONS", None)
        function = registry.get_interface(impl, eager) if registry else None
        want = ATTENTION[impl]
    else:
        raise ConversionError(
            f"cannot convert layer {name!r}: attention implementation {impl!r} "
            f"(known: eager, {', '.join(ATTENTION)}); a custom one may not compute "
            "softmax attention"
        )
    library = getattr(sys.modules.get(want[0]), want[1], None)
    if function is None or function is not library or foreign_code(function):
        what = getattr(function, "__qualname__", repr(function))
        where = getattr(function, "__module__", "?")
        raise ConversionError(
            f"cannot convert layer {name!r}: the attention registered as {impl!r} "
            f"(transformers' AttentionInterface) is {where}.{what}, not transformers' "
            f"own {want[0]}.{want[1]}"
        )


def _activation(name: str, layer: Any, hidden_act: object) -> Activation:
    module = getattr(layer.intermediate, "intermediate_act_fn", None)
    found = read_activation(module)
    if found is None:
        what = f"{type(module).__module__}.{type(module).__qualname__}"
        raise ConversionError(
            f"cannot convert {name}.intermediate.intermediate_act_fn: the installed "
            f"module is {what} (config.hidden_act = {hidden_act!r}); the converter "
            "fits GELU or ReLU only"
        )
    return found


def check_norms(model: nn.Module, d: int) -> float:
    """The one epsilon of every LayerNorm (each normalised over the width ``d``)."""
    eps: dict[float, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            if tuple(module.normalized_shape) != (d,):
                raise ConversionError(
                    f"cannot convert {name}: normalised shape "
                    f"{tuple(module.normalized_shape)}, not the width ({d},)"
                )
            eps.setdefault(float(module.eps), name)
    if len(eps) > 1:
        (a, first), (b, second) = list(eps.items())[:2]
        raise ConversionError(
            f"cannot convert: the LayerNorms' epsilons differ ({first}: {a!r}, "
            f"{second}: {b!r}); the converted model uses one"
        )
    return next(iter(eps), 1e-12)


def check_installed(
    model: nn.Module, base: str, encoder: Any, head_dim: int
) -> SourceFunctions:
    """Refuse what the converter cannot represent; the functions of what it can."""
    check_global_hooks()
    for name, module in model.named_modules():
        check_module(name, module)
    for pname, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            raise ConversionError(f"cannot convert {pname}: it holds NaN or inf")
        if param.dtype not in (torch.float32, torch.float64):
            raise ConversionError(
                f"cannot convert a {param.dtype} model: its logits differ from any "
                "float64 conversion by its rounding; convert model.float() instead"
            )
    config = getattr(model, "config", None)
    hidden_act = getattr(config, "hidden_act", None)
    activations = []
    for i, layer in enumerate(encoder):
        where = f"{base}.encoder.layer.{i}"
        check_attention(f"{where}.attention.self", layer.attention.self, head_dim)
        activations.append(_activation(where, layer, hidden_act))
    pooler = getattr(getattr(model, base), "pooler", None)
    if base == "bert" and type(getattr(pooler, "activation", None)) is not nn.Tanh:
        what = type(getattr(pooler, "activation", None))
        raise ConversionError(
            f"cannot convert bert.pooler.activation: the installed module is "
            f"{what.__module__}.{what.__qualname__}, not torch.nn.Tanh; the converter "
            "fits tanh for the pooler"
        )
    return SourceFunctions(tuple(activations))
