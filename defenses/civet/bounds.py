r"""Interval bound propagation (IBP) through the layers our VAEs use.

A box :math:`[l, u]` is carried as centre :math:`c = (u + l)/2` and radius
:math:`r = (u - l)/2`. For an affine layer :math:`f(x) = Wx + b` (Linear, Conv2d,
ConvTranspose2d are all of this form) the image of the box lies in

.. math::  [\,Wc + b - |W| r,\; Wc + b + |W| r\,],

(Gowal et al., "On the effectiveness of interval bound propagation", 2018). A
monotone non-decreasing elementwise map :math:`g` (ReLU, LeakyReLU with a
non-negative slope, Sigmoid, Tanh, Softplus, ELU, Hardtanh) maps the box to
:math:`[g(l), g(u)]`; max pooling is monotone in every input, and reshapes act on
both ends. Every operation is differentiable in the parameters, so the bounds can be
trained through (certified training, Xu et al., "Support is All You Need for
Certified VAE Training", ICLR 2025).

A layer outside this list raises :class:`UnsupportedLayerError` naming it: an
unsupported layer never yields a silently unsound bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
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
        """Return ``self`` after checking shapes, NaN and ``lower <= upper``.

        Raises
        ------
        ValueError
            If the bounds differ in shape, hold NaN or cross.
        """
        if self.lower.shape != self.upper.shape:
            raise ValueError(
                f"Box bounds must have the same shape, got {tuple(self.lower.shape)} "
                f"and {tuple(self.upper.shape)}"
            )
        if bool(torch.isnan(self.lower).any() | torch.isnan(self.upper).any()):
            raise ValueError("Box bounds hold NaN")
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


_MONOTONE: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
    nn.ELU,
    nn.Hardtanh,
    nn.ReLU6,
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
    nn.MaxPool2d,
)


def _affine(
    box: Box,
    apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> Box:
    center = apply(box.center, weight, bias)
    radius = apply(box.radius, weight.abs(), None)
    return Box(center - radius, center + radius)


def _linear(layer: nn.Linear, box: Box) -> Box:
    return _affine(box, F.linear, layer.weight, layer.bias)


def _conv2d(layer: nn.Conv2d, box: Box) -> Box:
    def apply(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(
            x, w, b, layer.stride, layer.padding, layer.dilation, layer.groups
        )

    return _affine(box, apply, layer.weight, layer.bias)


def _conv_transpose2d(layer: nn.ConvTranspose2d, box: Box) -> Box:
    padding = layer.padding
    if isinstance(padding, str):
        raise UnsupportedLayerError(f"{layer!r}: string padding is not supported")

    def apply(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.conv_transpose2d(
            x,
            w,
            b,
            layer.stride,
            padding,
            layer.output_padding,
            layer.groups,
            layer.dilation,
        )

    return _affine(box, apply, layer.weight, layer.bias)


def _is_monotone(layer: nn.Module) -> bool:
    if isinstance(layer, nn.LeakyReLU):
        return layer.negative_slope >= 0
    if isinstance(layer, nn.ELU):
        return layer.alpha >= 0
    if isinstance(layer, nn.Hardtanh):
        return layer.min_val <= layer.max_val
    if isinstance(layer, nn.Dropout):
        return not layer.training
    return isinstance(layer, _MONOTONE)


def _rule(layer: nn.Module) -> Callable[[Box], Box]:
    """The propagation rule of one (non-sequential) layer."""
    if isinstance(layer, nn.Linear):
        return lambda box: _linear(layer, box)
    if isinstance(layer, nn.Conv2d) and layer.padding_mode == "zeros":
        return lambda box: _conv2d(layer, box)
    if isinstance(layer, nn.ConvTranspose2d):
        return lambda box: _conv_transpose2d(layer, box)
    if _is_monotone(layer):
        return lambda box: Box(layer(box.lower), layer(box.upper))
    raise UnsupportedLayerError(
        f"interval bound propagation has no sound rule for layer {layer!r} "
        f"({type(layer).__name__}); supported: Linear, Conv2d (zero padding), "
        "ConvTranspose2d, monotone activations (ReLU, LeakyReLU with slope >= 0, "
        "Sigmoid, Tanh, Softplus, ELU with alpha >= 0, Hardtanh, ReLU6), MaxPool2d, "
        "Flatten, Unflatten, Identity and Dropout in eval mode"
    )


def ibp(module: nn.Module, box: Box) -> Box:
    """Propagate ``box`` through ``module``: a sound, differentiable output box.

    Parameters
    ----------
    module : torch.nn.Module
        A supported layer, or an :class:`torch.nn.Sequential` of them (nested
        sequentials are fine).
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
        If a layer has no sound rule here (e.g. BatchNorm, SiLU, Dropout in
        training mode); the message names the layer.
    """
    return _propagate(module, box.validate())


def _propagate(module: nn.Module, box: Box) -> Box:
    if isinstance(module, nn.Sequential):
        for layer in module:
            box = _propagate(layer, box)
        return box
    return _rule(module)(box)


def check_supported(module: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` if ``module`` holds an unsupported layer."""
    if isinstance(module, nn.Sequential):
        for layer in module:
            check_supported(layer)
        return
    _rule(module)
