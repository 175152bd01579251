r"""Fused interval arithmetic for chains of Linear and monotone layers (training speed).

The graph propagation of :mod:`defenses.civet.graph` carries a box as two tensors
and bounds a Linear layer by centre and radius (nine tensor operations). For a
chain of ``nn.Linear`` and monotone elementwise layers this module carries the box
as *one* tensor ``[l | u]`` (the two ends side by side along the last dimension)
and bounds a Linear layer :math:`Wx + b` with *one* matrix product:

.. math::  [\,l \mid u\,] \begin{pmatrix} W_+^\top & W_-^\top \\
           W_-^\top & W_+^\top \end{pmatrix} + [\,b \mid b\,]
           = [\,W_+ l + W_- u + b \mid W_+ u + W_- l + b\,],

with :math:`W_+ = \max(W, 0)`, :math:`W_- = \min(W, 0)`; this is exactly the
centre-radius rule, :math:`Wc \pm |W|r`, written without the cancellation. A
monotone layer (ReLU, ReLU6, Sigmoid, Tanh, Identity, LeakyReLU with a slope >= 0,
Hardtanh) is applied to the whole tensor. Both rules are the registry's rules in
another layout, so the bounds are the same up to rounding (tested against the
graph path).

:func:`fused_parts` recognises the built-in :class:`~defenses.civet.model.VAE`
container whose trunk, heads and decoder are such chains (the quick benchmark's
model) and returns the fused encoder and decoder; anything else (a user's module,
a convolution, a parametrized or subclassed layer) returns None and is bounded
through its traced graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from defenses.civet.box import Box
from defenses.civet.model import VAE
from defenses.civet.stacked import Plan, plan

Chain = Callable[[torch.Tensor], torch.Tensor]

_MONOTONE = (nn.ReLU, nn.ReLU6, nn.Sigmoid, nn.Tanh, nn.Identity, nn.Hardtanh)


def _flatten(module: nn.Module) -> list[nn.Module] | None:
    if type(module) is nn.Sequential:
        out: list[nn.Module] = []
        for child in module:
            inner = _flatten(child)
            if inner is None:
                return None
            out.extend(inner)
        return out
    return [module]


def _fusable(layer: nn.Module) -> bool:
    if getattr(layer, "inplace", False) or layer._forward_hooks:
        return False
    if layer._forward_pre_hooks:
        return False
    if type(layer) is nn.Linear:
        return True
    if type(layer) is nn.LeakyReLU:
        return layer.negative_slope >= 0
    if type(layer) is nn.Hardtanh:
        return layer.min_val <= layer.max_val
    return type(layer) in _MONOTONE


def block(weight: torch.Tensor) -> torch.Tensor:
    """The weight ``[[W+, W-], [W-, W+]]`` of the fused interval product."""
    positive, negative = weight.clamp(min=0), weight.clamp(max=0)
    return torch.cat(
        [torch.cat([positive, negative], 1), torch.cat([negative, positive], 1)], 0
    )


class IntervalLinear(torch.autograd.Function):
    """``[l | u] -> [W+ l + W- u + b | W+ u + W- l + b]`` as one autograd node.

    The backward pass is written out: with ``G`` the gradient of the product's
    weight (four quadrants), ``dW = (G11 + G22) [W >= 0] + (G12 + G21) [W <= 0]``
    (the gradients ``clamp`` passes, ties included), ``db`` the sum of both
    halves of the output gradient, and the input gradient ``grad @ block``.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        ends: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """The product ``[l | u] @ block(W).T + [b | b]``."""
        fused = block(weight)
        both = None if bias is None else torch.cat([bias, bias])
        ctx.save_for_backward(ends, weight, fused)
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        return F.linear(ends, fused, both)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Gradients of ``ends``, ``weight`` and ``bias`` (see the class docstring)."""
        ends, weight, fused = ctx.saved_tensors  # type: ignore[attr-defined]
        out, into = weight.shape
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        grad_ends = grad @ fused if needs[0] else None
        grad_weight = grad_bias = None
        if needs[1]:
            g = grad.reshape(-1, 2 * out).T @ ends.reshape(-1, 2 * into)
            positive = g[:out, :into] + g[out:, into:]
            negative = g[:out, into:] + g[out:, :into]
            grad_weight = positive * (weight >= 0) + negative * (weight <= 0)
        if ctx.has_bias and needs[2]:  # type: ignore[attr-defined]
            halves = grad.reshape(-1, 2 * out).sum(dim=0)
            grad_bias = halves[:out] + halves[out:]
        return grad_ends, grad_weight, grad_bias


def chain(layers: Sequence[nn.Module]) -> Chain:
    """The fused bound of a chain of fusable layers, on ``[l | u]`` tensors."""

    def run(ends: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            if type(layer) is nn.Linear:
                ends = IntervalLinear.apply(  # type: ignore[no-untyped-call]
                    ends, layer.weight, layer.bias
                )
            else:
                ends = layer(ends)
        return ends

    return run


def join(box: Box) -> torch.Tensor:
    """``[l | u]`` of a box of flat rows."""
    return torch.cat([box.lower, box.upper], dim=-1)


def split(ends: torch.Tensor) -> Box:
    """The box of an ``[l | u]`` tensor.

    The two ends are ordered: the halves of a point box are the same sums in
    another order and may round a unit in the last place apart either way.
    """
    lower, upper = ends.chunk(2, dim=-1)
    return Box(torch.minimum(lower, upper), torch.maximum(lower, upper))


@dataclass(frozen=True)
class FusedVAE:
    """Fused bounds of a built-in VAE container's encoder and decoder.

    ``plan`` is set when every part is a Linear/ReLU chain (the quick benchmark's
    model): certified training then computes its whole objective in one node,
    :class:`defenses.civet.stacked.CivetObjective`; otherwise it uses
    :meth:`training_terms` on this module's ``[l | u]`` chains.
    """

    model: VAE
    trunk: Chain
    mu_head: Chain
    logvar_head: Chain
    decoder: Chain
    plan: Plan | None = None

    def latent_bounds(self, box: Box) -> tuple[Box, Box]:
        """Bounds of ``mu`` and the clamped ``logvar`` over the input ``box``."""
        hidden = self.trunk(join(box))
        logvar = self.logvar_head(hidden).clamp(*self.model.logvar_range)
        return split(self.mu_head(hidden)), split(logvar)

    def output_bounds(self, box: Box) -> Box:
        """Bounds of the reconstruction over the latent ``box``."""
        return split(self.decoder(join(box)))

    def training_terms(
        self, x: torch.Tensor, nu: torch.Tensor, ball: Box, halfwidths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Box]:
        r"""The plain pass and the certified bound of certified training, fused.

        The inputs ride along the input ``ball`` as point boxes ``[x | x]`` (whose
        lower half is the layer's output), so one pass through each part gives
        :math:`\mu(x)`, :math:`\log\sigma^2(x)`, the reconstruction of
        :math:`z = \mu + \sigma \odot \nu` and the output box of the support
        :math:`[\mu^l - k_i \sigma^u, \mu^u + k_i \sigma^u]` with one half-width
        ``halfwidths[i]`` per row.

        Returns
        -------
        reconstruction, mu, logvar, output box
        """
        n, d = x.shape[0], self.model.latent_dim
        hidden = self.trunk(torch.cat([join(ball), torch.cat([x, x], -1)]))
        mu_ends = self.mu_head(hidden)
        logvar_ends = self.logvar_head(hidden).clamp(*self.model.logvar_range)
        mu, logvar = mu_ends[n:, :d], logvar_ends[n:, :d]
        low, high = mu_ends[:n].chunk(2, dim=-1)
        spread = halfwidths[:, None] * torch.exp(0.5 * logvar_ends[:n, d:])
        z = mu + torch.exp(0.5 * logvar) * nu
        rows = torch.cat(
            [torch.cat([low - spread, high + spread], -1), torch.cat([z, z], -1)]
        )
        out = self.decoder(rows)
        return out[n:, : out.shape[1] // 2], mu, logvar, split(out[:n])


def fused_parts(module: nn.Module) -> FusedVAE | None:
    """The fused bounds of ``module`` if it is a fusable built-in container."""
    if type(module) is not VAE or module._forward_hooks:
        return None
    parts, flat = [], []
    for part in (module.trunk, module.mu_head, module.logvar_head, module.decoder):
        layers = _flatten(part)
        if layers is None or not all(_fusable(layer) for layer in layers):
            return None
        parts.append(chain(layers))
        flat.append(layers)
    trunk, mu_head, logvar_head, decoder = parts
    return FusedVAE(module, trunk, mu_head, logvar_head, decoder, plan(module, flat))
