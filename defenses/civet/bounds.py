r"""Interval bound propagation (IBP): the box domain and the rule of every layer.

A box :math:`[l, u]` is carried as centre :math:`c = (u + l)/2` and radius
:math:`r = (u - l)/2`. For an affine layer :math:`f(x) = Wx + b` (Linear, Conv2d,
ConvTranspose2d are all of this form) the image of the box lies in

.. math::  [\,Wc + b - |W| r,\; Wc + b + |W| r\,],

(Gowal et al., "On the effectiveness of interval bound propagation", 2018). A
monotone non-decreasing elementwise map :math:`g` (ReLU, LeakyReLU with a
non-negative slope, Sigmoid, Tanh, Softplus, ELU with alpha >= 0, Hardtanh) maps the
box to :math:`[g(l), g(u)]`. So does every map that is non-decreasing in each input:
max and average pooling, nearest and (bi/tri)linear upsampling (convex combinations
of inputs), eval-mode Dropout (the identity) and reshapes.

*Per-channel affine maps* (BatchNorm in eval mode,
:math:`y = s \odot x + t` with :math:`s = \gamma / \sqrt{\hat\sigma^2 + \epsilon}`
and :math:`t = \beta - s\hat\mu`) take :math:`[\min(s l, s u) + t,
\max(s l, s u) + t]`, exact for either sign of :math:`s`.

*Unimodal activations* fall, then rise, around their minimiser :math:`x^\ast`: SiLU
:math:`x\,\sigma(x)` (:math:`x^\ast \approx -1.2785`), GELU :math:`x\,\Phi(x)`
(:math:`x^\ast \approx -0.7518`, and the tanh approximation), LeakyReLU with a
negative slope and ELU with a negative alpha (:math:`x^\ast = 0`). Over
:math:`[l, u]` the maximum is :math:`\max(g(l), g(u))` and the minimum is
:math:`g(x^\ast)` if :math:`l \le x^\ast \le u`, else :math:`\min(g(l), g(u))`:
both exact.

Every rule is differentiable in the parameters, so the bounds can be trained through
(certified training, Xu et al., "Support is All You Need for Certified VAE
Training", ICLR 2025). :mod:`defenses.civet.graph` applies these rules along a
module's traced graph; a layer outside this list raises
:class:`UnsupportedLayerError` naming it: an unsupported layer never yields a
silently unsound bound.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from scipy import optimize, special
from torch import nn


class UnsupportedLayerError(TypeError):
    """Bound propagation met a layer it has no sound rule for."""


@dataclass(frozen=True)
class Box:
    """An axis-aligned box ``[lower, upper]`` of a batch of tensors.

    Parameters
    ----------
    lower, upper : torch.Tensor
        Same shape, ``lower <= upper`` elementwise, no NaN (checked by
        :meth:`validate`, which :func:`ibp` calls once on its input box; the
        boxes built inside the propagation are sound by construction).
    """

    lower: torch.Tensor
    upper: torch.Tensor

    def validate(self) -> Box:
        """Return ``self`` after checking dtypes, shapes, finiteness and order.

        Raises
        ------
        TypeError
            If the bounds are not floating-point tensors of one dtype.
        ValueError
            If the bounds differ in shape, hold NaN or inf, or cross.
        """
        if self.lower.shape != self.upper.shape:
            raise ValueError(
                f"Box bounds must have the same shape, got {tuple(self.lower.shape)} "
                f"and {tuple(self.upper.shape)}"
            )
        for end in (self.lower, self.upper):
            if not isinstance(end, torch.Tensor) or not end.is_floating_point():
                raise TypeError(
                    "Box bounds must be floating-point tensors, got "
                    f"{getattr(end, 'dtype', type(end).__name__)}"
                )
        if self.lower.dtype != self.upper.dtype:
            raise TypeError(
                f"Box bounds must share a dtype, got {self.lower.dtype} and "
                f"{self.upper.dtype}"
            )
        if not bool(
            torch.isfinite(self.lower).all() & torch.isfinite(self.upper).all()
        ):
            raise ValueError("Box bounds hold NaN or inf")
        if bool((self.lower > self.upper).any()):
            gap = float((self.lower - self.upper).max())
            raise ValueError(f"Box needs lower <= upper; lower exceeds upper by {gap}")
        return self

    @classmethod
    def linf_ball(
        cls, x: torch.Tensor, eps: float, domain: tuple[float, float] | None = None
    ) -> Box:
        """The L-infinity ball of radius ``eps`` around ``x``, cut to ``domain``."""
        lower, upper = x - eps, x + eps
        if domain is not None:
            lower, upper = lower.clamp(*domain), upper.clamp(*domain)
        return cls(lower, upper)

    @property
    def center(self) -> torch.Tensor:
        """Midpoint ``(upper + lower) / 2``."""
        return (self.upper + self.lower) / 2

    @property
    def radius(self) -> torch.Tensor:
        """Half-width ``(upper - lower) / 2``."""
        return (self.upper - self.lower) / 2

    def contains(self, x: torch.Tensor, tol: float = 0.0) -> torch.Tensor:
        """Per-row flag: every coordinate of ``x`` lies in the box, up to ``tol``."""
        inside = (x >= self.lower - tol) & (x <= self.upper + tol)
        return inside.reshape(inside.shape[0], -1).all(dim=1)


Rule = Callable[[Box], Box]


def monotone(box: Box, fn: Callable[[torch.Tensor], torch.Tensor]) -> Box:
    """Image of ``box`` under a map that is non-decreasing in every input."""
    return Box(fn(box.lower), fn(box.upper))


def affine(
    box: Box,
    apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> Box:
    """Image of ``box`` under ``x -> apply(x, weight, bias)``, linear in ``x``.

    Centre :math:`Wc + b`, radius :math:`|W| r`.
    """
    center = apply(box.center, weight, bias)
    radius = apply(box.radius, weight.abs(), None)
    return Box(center - radius, center + radius)


def scale_shift(box: Box, scale: torch.Tensor, shift: torch.Tensor | float) -> Box:
    """Image of ``box`` under the elementwise map ``scale * x + shift`` (any sign)."""
    a, b = box.lower * scale, box.upper * scale
    return Box(torch.minimum(a, b) + shift, torch.maximum(a, b) + shift)


def unimodal(
    box: Box,
    fn: Callable[[torch.Tensor], torch.Tensor],
    argmin: float,
    minimum: float,
) -> Box:
    r"""Exact image of ``box`` under an elementwise map falling then rising.

    ``fn`` decreases on :math:`(-\infty, x^\ast]` and increases on
    :math:`[x^\ast, \infty)`, with :math:`x^\ast` = ``argmin`` and
    :math:`g(x^\ast)` = ``minimum``.
    """
    low, high = fn(box.lower), fn(box.upper)
    inside = (box.lower <= argmin) & (box.upper >= argmin)
    floor = torch.where(inside, torch.full_like(low, minimum), torch.minimum(low, high))
    return Box(floor, torch.maximum(low, high))


def _stationary(
    derivative: Callable[[float], float], value: Callable[[float], float]
) -> tuple[float, float]:
    """The minimiser on [-3, -0.1] (a root of the derivative) and the minimum."""
    point = float(optimize.brentq(derivative, -3.0, -0.1, xtol=1e-15, rtol=1e-15))
    return point, float(value(point))


def _silu_slope(x: float) -> float:
    s = float(special.expit(x))
    return s * (1.0 + x * (1.0 - s))


def _gelu_slope(x: float) -> float:
    return float(special.ndtr(x)) + x * math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


_C, _A = math.sqrt(2.0 / math.pi), 0.044715


def _gelu_tanh(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(_C * (x + _A * x**3)))


def _gelu_tanh_slope(x: float) -> float:
    t = math.tanh(_C * (x + _A * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3.0 * _A * x * x)


SILU_MIN = _stationary(_silu_slope, lambda x: x * float(special.expit(x)))
GELU_MIN = {
    "none": _stationary(_gelu_slope, lambda x: x * float(special.ndtr(x))),
    "tanh": _stationary(_gelu_tanh_slope, _gelu_tanh),
}
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

_MONOTONE: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
    nn.Hardtanh,
    nn.ReLU6,
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
    *POOLS,
)
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


def _activation(layer: nn.Module) -> Rule | None:
    """Rules of the elementwise activations, monotone or unimodal."""
    if isinstance(layer, nn.SiLU):
        return lambda box: unimodal(box, layer, *SILU_MIN)
    if isinstance(layer, nn.GELU) and layer.approximate in GELU_MIN:
        return lambda box: unimodal(box, layer, *GELU_MIN[layer.approximate])
    if isinstance(layer, nn.LeakyReLU | nn.ELU):
        slope = layer.negative_slope if isinstance(layer, nn.LeakyReLU) else layer.alpha
        if slope >= 0:
            return lambda box: monotone(box, layer)
        return lambda box: unimodal(box, layer, 0.0, 0.0)
    if isinstance(layer, nn.Hardtanh) and layer.min_val > layer.max_val:
        return None
    if isinstance(layer, _MONOTONE):
        return lambda box: monotone(box, layer)
    return None


def layer_rule(layer: nn.Module) -> Rule:
    """The rule of one leaf layer, or :class:`UnsupportedLayerError` naming it."""
    if isinstance(layer, nn.Linear):
        return lambda box: affine(box, F.linear, layer.weight, layer.bias)
    if isinstance(layer, nn.Conv1d | nn.Conv2d) and layer.padding_mode == "zeros":
        return _conv(layer)
    if isinstance(layer, nn.ConvTranspose1d | nn.ConvTranspose2d):
        return _conv_transpose(layer)
    if isinstance(layer, _BATCHNORM):
        return _batch_norm(layer)
    if isinstance(layer, _DROPOUT) and not layer.training:
        return lambda box: box
    if getattr(layer, "return_indices", False):
        raise UnsupportedLayerError(f"{layer!r}: pooling indices are not bounded")
    if getattr(layer, "inplace", False):
        raise UnsupportedLayerError(
            f"{layer!r} works in place; bound a copy with inplace=False"
        )
    if isinstance(layer, nn.Upsample) and layer.mode in LINEAR_MODES:
        return lambda box: monotone(box, layer)
    rule = _activation(layer)
    if rule is not None:
        return rule
    raise UnsupportedLayerError(
        f"interval bound propagation has no sound rule for layer {layer!r} "
        f"({type(layer).__name__}); supported: Linear, Conv1d/Conv2d (zero "
        "padding), ConvTranspose1d/2d, BatchNorm1d/2d/3d and Dropout in eval mode, "
        "Avg/Max/Adaptive pooling, Upsample (nearest, linear modes), Flatten, "
        "Unflatten, Identity, the monotone activations (ReLU, ReLU6, Sigmoid, Tanh, "
        "Softplus, Hardtanh) and SiLU, GELU, LeakyReLU, ELU"
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
