"""What a user's module must be before S3T copies it, and the refusals that say so.

:func:`admit` runs first in :class:`~defenses.s3t.adapters.AdaptedModel`: a
``torch.compile`` wrapper is unwrapped (S3T runs the module eagerly), a TorchScript
module is refused (its forward runs no hooks on ``nn.Linear`` layers, where the
adapters are bound), old-style ``weight_norm`` / ``spectral_norm`` hooks are refused
(they rewrite the weight in forward), and non-finite or non-float32 parameters and
buffers are refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from defenses.checks import check_finite_module


def eager(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper holds (S3T runs it eagerly).

    Adapters are bound through forward hooks and replayed bit for bit; a compiled
    graph would be recompiled on every binding and need not match eager results
    to the bit, so the original module is used (its layers keep their names).
    """
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner
    return model


def check_float32(model: nn.Module) -> None:
    """Refuse a model whose floating parameters or buffers are not float32 (named).

    S3T's inputs, adapters and heads are float32 tensors; a float64 (or half)
    model would fail deep inside its first layer.
    """
    for kind, items in (
        ("parameter", model.named_parameters()),
        ("buffer", model.named_buffers()),
    ):
        for name, tensor in items:
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                raise ValueError(
                    f"model: its {kind} {name!r} is {tensor.dtype}, but S3T trains "
                    "float32 models (inputs, adapters and heads are float32); call "
                    "model.float() first"
                )


def check_old_parametrizations(model: nn.Module) -> None:
    """Refuse old-style ``weight_norm`` / ``spectral_norm`` hooks (named).

    ``torch.nn.utils.weight_norm`` and ``spectral_norm`` rewrite the layer's
    ``weight`` attribute in a forward pre-hook (state a forward writes; the first
    cannot even be deep-copied); their ``torch.nn.utils.parametrizations``
    versions compute the weight without writing state.
    """
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for name, module in model.named_modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm | SpectralNorm):
                kind = (
                    "weight_norm" if isinstance(hook, WeightNorm) else "spectral_norm"
                )
                raise ValueError(
                    f"model: {name or type(model).__name__} carries an old-style "
                    f"torch.nn.utils.{kind} hook, which rewrites its "
                    f"{hook.name!r} attribute in forward; use "
                    f"torch.nn.utils.parametrizations.{kind} instead"
                )


def admit(model: nn.Module) -> nn.Module:
    """The module S3T will copy, or a refusal naming what is wrong with it.

    Raises
    ------
    TypeError
        A TorchScript module.
    ValueError
        A parameter or buffer holds NaN or inf, or is not float32, or a layer
        carries an old-style ``weight_norm`` / ``spectral_norm`` hook (named).
    """
    model = eager(model)
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"model: a TorchScript module ({type(model).__name__}, from "
            "torch.jit.script or torch.jit.trace) cannot carry S3T's adapters: "
            "they are bound by forward hooks on its nn.Linear / nn.Conv2d "
            "layers, which a scripted forward does not have; pass the eager "
            "nn.Module (torch.compile(model) is accepted)"
        )
    check_old_parametrizations(model)
    check_finite_module("model", model)
    check_float32(model)
    return model
