r"""Interval bound propagation (IBP): the rule of every ``torch.nn`` layer.

Boxes and the generic rules are in :mod:`defenses.civet.box`: an affine layer
:math:`f(x) = Wx + b` (Linear, Conv1d/2d, ConvTranspose1d/2d) sends the box with
centre :math:`c` and radius :math:`r` into :math:`[Wc + b - |W| r, Wc + b + |W| r]`
(Gowal et al., 2018); a monotone non-decreasing elementwise map :math:`g` (ReLU,
LeakyReLU with a non-negative slope, Sigmoid, Tanh, ELU with alpha >= 0, Hardtanh,
ReLU6) maps it to :math:`[g(l), g(u)]`. So does every map that is non-decreasing in
each input: max and average pooling with a positive divisor (an average pool with
a negative ``divisor_override`` is non-increasing and takes the ends swapped),
nearest and (bi/tri)linear upsampling (convex combinations of inputs), eval-mode
Dropout (the identity) and reshapes.

*Per-channel affine maps* (BatchNorm in eval mode,
:math:`y = s \odot x + t` with :math:`s = \gamma / \sqrt{\hat\sigma^2 + \epsilon}`
and :math:`t = \beta - s\hat\mu`) take :math:`[\min(s l, s u) + t,
\max(s l, s u) + t]`, exact for either sign of :math:`s`. The unimodal activations
(SiLU, GELU, LeakyReLU and ELU with a negative slope) and Softplus, which jumps at
its threshold, have their own rules (:mod:`defenses.civet.activations`).

Every layer class with a rule is a key of :data:`LAYER_RULES` (exact classes: a
user's subclass may compute something else, and fx traces into it instead); each
rule has a property test against dense sampling
(``tests/defenses/civet/soundness``), and a test over this registry fails for a
class without one. Every rule is differentiable in the parameters, so the bounds
can be trained through (certified training, Xu et al., "Support is All You Need
for Certified VAE Training", ICLR 2025). :mod:`defenses.civet.graph` applies these
rules along a module's traced graph; a layer outside the registry raises
:class:`UnsupportedLayerError` naming it: an unsupported layer never yields a
silently unsound bound.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from defenses.civet.activations import (
    GELU_MIN,
    SILU_MIN,
    sloped,
    softplus,
    unimodal,
)
from defenses.civet.box import (
    Box,
    Rule,
    UnsupportedLayerError,
    affine,
    monotone,
    scale_shift,
)

__all__ = [
    "GELU_MIN",
    "LAYER_RULES",
    "LINEAR_MODES",
    "POOLS",
    "SILU_MIN",
    "Box",
    "Rule",
    "UnsupportedLayerError",
    "affine",
    "batch_norm_affine",
    "channel_affine",
    "check_supported",
    "layer_rule",
    "monotone",
    "out_of_place",
    "pooled",
    "scale_shift",
    "unimodal",
]

LINEAR_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear", "area")

POOLS: tuple[type[nn.Module], ...] = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
)
"""The pooling layers (max and average, fixed and adaptive, 1-d and 2-d)."""

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout)
_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _conv(layer: nn.Conv1d | nn.Conv2d) -> Rule:
    conv = F.conv1d if isinstance(layer, nn.Conv1d) else F.conv2d

    def apply(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = conv(
            x, w, b, layer.stride, layer.padding, layer.dilation, layer.groups
        )
        return out

    return lambda box: affine(box, apply, layer.weight, layer.bias)


def _conv_transpose(layer: nn.ConvTranspose1d | nn.ConvTranspose2d) -> Rule:
    padding = layer.padding
    if isinstance(padding, str):
        raise UnsupportedLayerError(f"{layer!r}: string padding is not supported")
    conv = (
        F.conv_transpose1d
        if isinstance(layer, nn.ConvTranspose1d)
        else F.conv_transpose2d
    )

    def apply(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = conv(
            x,
            w,
            b,
            layer.stride,
            padding,
            layer.output_padding,
            layer.groups,
            layer.dilation,
        )
        return out

    return lambda box: affine(box, apply, layer.weight, layer.bias)


def batch_norm_affine(
    mean: torch.Tensor,
    var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Scale and shift of eval-mode batch normalisation.

    :math:`s = \gamma/\sqrt{\hat\sigma^2 + \epsilon}`, :math:`t = \beta - s\hat\mu`.
    """
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    return scale, shift


def channel_affine(box: Box, scale: torch.Tensor, shift: torch.Tensor) -> Box:
    """:func:`scale_shift` with per-channel (dimension 1) ``scale`` and ``shift``."""
    shape = (1, -1) + (1,) * (box.lower.ndim - 2)
    return scale_shift(box, scale.reshape(shape), shift.reshape(shape))


def _batch_norm(layer: nn.modules.batchnorm._BatchNorm) -> Rule:
    if layer.training or layer.running_mean is None or layer.running_var is None:
        raise UnsupportedLayerError(
            f"{layer!r} uses batch statistics (training mode or no running "
            "statistics), which have no sound interval rule; call .eval() first"
        )
    mean, var = layer.running_mean, layer.running_var

    def rule(box: Box) -> Box:
        scale, shift = batch_norm_affine(mean, var, layer.weight, layer.bias, layer.eps)
        return channel_affine(box, scale, shift)

    return rule


def pooled(box: Box, fn: Callable[[torch.Tensor], torch.Tensor], divisor: Any) -> Box:
    """A pooling map: monotone, or non-increasing for a negative divisor override."""
    if divisor is not None and divisor < 0:
        return Box(fn(box.upper), fn(box.lower))
    return monotone(box, fn)


def _pool(layer: nn.Module) -> Rule:
    if getattr(layer, "return_indices", False):
        raise UnsupportedLayerError(f"{layer!r}: pooling indices are not bounded")
    divisor = getattr(layer, "divisor_override", None)
    return lambda box: pooled(box, layer, divisor)


def _monotone(layer: nn.Module) -> Rule:
    return lambda box: monotone(box, layer)


def _hardtanh(layer: nn.Hardtanh) -> Rule:
    if layer.min_val > layer.max_val:
        raise UnsupportedLayerError(f"{layer!r}: min_val exceeds max_val")
    return _monotone(layer)


def _softplus(layer: nn.Softplus) -> Rule:
    beta, threshold = float(layer.beta), float(layer.threshold)
    softplus(Box(torch.zeros(1), torch.zeros(1)), beta, threshold)  # validates
    return lambda box: softplus(box, beta, threshold)


def _leaky(layer: nn.LeakyReLU | nn.ELU) -> Rule:
    slope = layer.negative_slope if isinstance(layer, nn.LeakyReLU) else layer.alpha
    fn = F.leaky_relu if isinstance(layer, nn.LeakyReLU) else F.elu
    return sloped(fn, float(slope))


def _silu(layer: nn.SiLU) -> Rule:
    return lambda box: unimodal(box, F.silu, *SILU_MIN)


def _gelu(layer: nn.GELU) -> Rule:
    if layer.approximate not in GELU_MIN:
        raise UnsupportedLayerError(f"{layer!r}: approximation {layer.approximate!r}")
    minimum = GELU_MIN[layer.approximate]
    return lambda box: unimodal(box, layer, *minimum)


def _linear(layer: nn.Linear) -> Rule:
    return lambda box: affine(box, F.linear, layer.weight, layer.bias)


def _zero_padded(layer: nn.Conv1d | nn.Conv2d) -> Rule:
    if layer.padding_mode != "zeros":
        raise UnsupportedLayerError(
            f"{layer!r}: padding_mode {layer.padding_mode!r} (only 'zeros')"
        )
    return _conv(layer)


def _dropout(layer: nn.Module) -> Rule:
    if layer.training:
        raise UnsupportedLayerError(f"{layer!r} in training mode is random")
    return lambda box: box


def _upsample(layer: nn.Upsample) -> Rule:
    if layer.mode not in LINEAR_MODES:
        raise UnsupportedLayerError(
            f"{layer!r}: mode {layer.mode!r} has negative weights"
        )
    return _monotone(layer)


LAYER_RULES: dict[type[nn.Module], Callable[[Any], Rule]] = {
    nn.Linear: _linear,
    nn.Conv1d: _zero_padded,
    nn.Conv2d: _zero_padded,
    nn.ConvTranspose1d: _conv_transpose,
    nn.ConvTranspose2d: _conv_transpose,
    **dict.fromkeys(_BATCHNORM, _batch_norm),
    **dict.fromkeys(_DROPOUT, _dropout),
    **dict.fromkeys(POOLS, _pool),
    nn.Upsample: _upsample,
    nn.ReLU: _monotone,
    nn.ReLU6: _monotone,
    nn.Sigmoid: _monotone,
    nn.Tanh: _monotone,
    nn.Identity: _monotone,
    nn.Flatten: _monotone,
    nn.Unflatten: _monotone,
    nn.Hardtanh: _hardtanh,
    nn.Softplus: _softplus,
    nn.LeakyReLU: _leaky,
    nn.ELU: _leaky,
    nn.SiLU: _silu,
    nn.GELU: _gelu,
}
"""Rule factory of every supported layer class (exact classes, see above)."""


def layer_class(layer: nn.Module) -> type[nn.Module]:
    """The layer's class, or the original class of a parametrized layer."""
    cls = type(layer)
    if parametrize.is_parametrized(layer):
        cls = cls.__bases__[0]
    return cls


def layer_rule(layer: nn.Module) -> Rule:
    """The rule of one leaf layer, or :class:`UnsupportedLayerError` naming it."""
    factory = LAYER_RULES.get(layer_class(layer))
    if factory is not None and getattr(layer, "inplace", False):
        raise UnsupportedLayerError(
            f"{layer!r} works in place; bound a copy with inplace=False"
        )
    if factory is not None:
        return factory(layer)
    raise UnsupportedLayerError(
        f"interval bound propagation has no sound rule for layer {layer!r} "
        f"({type(layer).__name__}); supported: Linear, Conv1d/Conv2d (zero "
        "padding), ConvTranspose1d/2d, BatchNorm1d/2d/3d and Dropout in eval mode, "
        "Avg/Max/Adaptive pooling, Upsample (nearest, linear modes), Flatten, "
        "Unflatten, Identity, the monotone activations (ReLU, ReLU6, Sigmoid, Tanh, "
        "Hardtanh), Softplus and SiLU, GELU, LeakyReLU, ELU"
    )


def out_of_place(layer: nn.Module) -> nn.Module:
    """``layer`` itself, or a shallow copy with ``inplace=False`` if it works in place.

    In a chain (a Sequential, or a graph node whose input has no other reader) the
    out-of-place layer computes the same values.
    """
    if not getattr(layer, "inplace", False):
        return layer
    copied = copy.copy(layer)
    setattr(copied, "inplace", False)  # noqa: B010
    return copied


def check_supported(module: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` if ``module`` holds an unsupported layer.

    Checks every leaf layer (a module without children) of ``module``.
    """
    for layer in module.modules():
        if next(layer.children(), None) is None:
            layer_rule(out_of_place(layer))
