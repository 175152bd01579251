r"""Certified training's objective in one pass, centre-radius form, backward by hand.

Certified training (:func:`defenses.civet.defense.train_vae`, ``method="civet"``)
needs, for every batch, the plain pass of the VAE on the ``n`` inputs and the
interval bounds of the same layers over ``n`` boxes. For the built-in
:class:`~defenses.civet.model.VAE` container whose parts are chains of Linear layers
with ReLUs (and a final Sigmoid on the decoder: the quick benchmark's model), this
module computes the whole objective as *one* autograd node, :class:`CivetObjective`,
carrying a batch as a stack of three blocks of rows,
``[points; centres; radii]`` (shape ``(3, n, features)``).

A Linear layer :math:`Wx + b` maps a box of centre :math:`c` and radius :math:`r` to
centre :math:`Wc + b` and radius :math:`|W| r` (Gowal et al., 2018; the rule of
:func:`defenses.civet.box.affine`): two products per layer, the points and the
centres in one (:math:`[p; c]\,W^\top + b`) and the radii in the other
(:math:`r\,|W|^\top`), where the ``[l | u]`` layout of :mod:`defenses.civet.fused`
costs a product four times as large. A ReLU maps the ends
:math:`l = c - r`, :math:`u = c + r` and returns to the centre-radius form.

The objective, per row (:mod:`defenses.civet.defense`):

.. math::  (1 - \kappa)\,\lVert D(\mu + \sigma \odot \nu) - x\rVert^2
           + \kappa W \sum_i \max\big((o^u_i - x_i)^2, (x_i - o^l_i)^2\big)
           + \beta\, \mathrm{KL}(\mathcal N(\mu, \sigma^2) \,\|\, \mathcal N(0, I)),

where :math:`[o^l, o^u]` bounds the decoder over the support
:math:`[\mu^l - k \sigma^u, \mu^u + k \sigma^u]` (centre :math:`c_\mu`, radius
:math:`r_\mu + k\sigma^u`), :math:`[\mu^l, \mu^u]` and :math:`\sigma^u` bound the
encoder over :math:`B_\infty(x, \varepsilon) \cap [a, b]^n`, the log-variance is
clamped, and the mean over the batch is returned.

The backward pass is written out with the derivative conventions of autograd's own
ops (ReLU passes no gradient at 0, ``clamp`` passes it at its limits,
``maximum`` splits it at ties, :math:`\partial |W| = \mathrm{sign}(W)`), so the
gradients equal autograd's gradients of the same formulas (tested in float64). For a
Linear layer with output gradients :math:`g_p, g_c, g_r`:

.. math::  \partial W = [g_p; g_c]^\top [p; c] + (g_r^\top r) \odot
           \mathrm{sign}(W),\quad \partial b = \textstyle\sum [g_p; g_c],\quad
           \partial [p; c] = [g_p; g_c]\,W,\quad \partial r = g_r |W|.

This pass is training's surrogate only: the certificate is always computed by
:func:`defenses.civet.certificate.certify`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from defenses.civet.model import VAE


@dataclass(frozen=True)
class Plan:
    """The built-in container as chains of ``(Linear, relu)`` steps.

    ``trunk`` and ``decoder`` list their Linear layers, each with a flag for the
    ReLU after it; ``sigmoid`` says whether the decoder ends in a Sigmoid.
    """

    model: VAE
    trunk: tuple[tuple[nn.Linear, bool], ...]
    decoder: tuple[tuple[nn.Linear, bool], ...]
    sigmoid: bool

    def parameters(self) -> list[torch.Tensor | None]:
        """Weights and biases in the order :class:`CivetObjective` takes them."""
        layers = [
            *(layer for layer, _ in self.trunk),
            self.model.mu_head,
            self.model.logvar_head,
            *(layer for layer, _ in self.decoder),
        ]
        out: list[torch.Tensor | None] = []
        for layer in layers:
            out += [layer.weight, layer.bias]  # type: ignore[list-item]
        return out


def _steps(
    layers: Sequence[nn.Module], end: type[nn.Module] | None
) -> tuple[tuple[tuple[nn.Linear, bool], ...], bool] | None:
    """``(Linear, relu)`` steps of a chain, and whether it ends in ``end``."""
    ended = end is not None and bool(layers) and type(layers[-1]) is end
    body = list(layers[:-1] if ended else layers)
    steps: list[tuple[nn.Linear, bool]] = []
    for layer in body:
        if type(layer) is nn.Linear:
            steps.append((layer, False))
        elif type(layer) is nn.ReLU and steps and not steps[-1][1]:
            steps[-1] = (steps[-1][0], True)
        else:
            return None
    return (tuple(steps), ended) if steps else None


def plan(module: VAE, parts: Sequence[Sequence[nn.Module]]) -> Plan | None:
    """The plan of a container whose parts are Linear/ReLU chains, or None.

    ``parts`` are the flattened trunk, mu head, logvar head and decoder. Each head
    must be one Linear layer and the decoder's last Linear must not be followed by
    a ReLU (a Sigmoid may end it); otherwise None (the ``[l | u]`` path of
    :mod:`defenses.civet.fused` applies).
    """
    trunk, mu_head, logvar_head, decoder = (list(p) for p in parts)
    heads = [mu_head, logvar_head]
    if any(len(h) != 1 or type(h[0]) is not nn.Linear for h in heads):
        return None
    front = _steps(trunk, None)
    back = _steps(decoder, nn.Sigmoid)
    if front is None or back is None or back[0][-1][1]:
        return None
    return Plan(module, front[0], back[0], back[1])


def _dense(
    stack: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A Linear layer (and ReLU) on a ``(3, n, in)`` stack; what backward needs.

    The points and the doubled centres :math:`[2p; l + u]` go through one product
    scaled by 1/2 (exact: powers of two), the widths :math:`u - l` through
    :math:`|W|/2`. Results are written in place (no copies of the stack).
    """
    points, lower, upper = stack.unbind(0)
    n = points.shape[0]
    rows = stack.new_empty((2 * n, stack.shape[2]))
    torch.add(points, points, out=rows[:n])
    torch.add(lower, upper, out=rows[n:])
    width = upper - lower
    half = weight.abs().mul_(0.5)
    out = stack.new_empty((3, n, weight.shape[0]))
    front = out[:2].view(2 * n, -1)
    if bias is None:
        torch.mm(rows, weight.t(), out=front).mul_(0.5)
    else:
        torch.addmm(bias, rows, weight.t(), alpha=0.5, out=front)
    spread = width @ half.t()
    centre = out[1]
    torch.add(centre, spread, out=out[2])
    centre.sub_(spread)
    if relu:
        out.clamp_(min=0.0)
        return out, (rows, width, half, out)
    return out, (rows, width, half)


def _dense_back(
    grad: torch.Tensor,
    weight: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    inputs: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the stack (empty unless ``inputs``), the weight and the bias.

    ``grad`` (the output's gradient) is owned by the caller and overwritten.
    """
    rows, width, half = saved[:3]
    if len(saved) > 3:  # ReLU: no gradient where the output is 0 (autograd's rule)
        grad = torch.ops.aten.threshold_backward(grad, saved[3], 0.0)
    _, lower, upper = grad.unbind(0)
    n = lower.shape[0]
    spread = upper - lower
    lower.add_(upper)
    front = grad[:2].view(2 * n, -1)
    grad_weight = (spread.t() @ width).mul_(weight.sign())
    grad_weight = torch.addmm(grad_weight, front.t(), rows, beta=0.5, alpha=0.5)
    grad_bias = front.sum(dim=0)
    if not inputs:
        return grad.new_empty(0), grad_weight, grad_bias
    out = grad.new_empty((3, n, weight.shape[1]))
    torch.mm(front, weight, out=out[:2].view(2 * n, -1))
    back = spread @ half
    torch.add(back, out[1], alpha=0.5, out=out[2])
    torch.sub(out[2], back, alpha=2.0, out=out[1])
    return out, grad_weight, grad_bias


@dataclass(frozen=True)
class Coefficients:
    """Radius, domain, clamp and mixing weights of one step's objective."""

    eps: float
    domain: tuple[float, float]
    logvar_range: tuple[float, float]
    plain: float
    robust: float
    kl: float


class CivetObjective(torch.autograd.Function):
    """The certified-training objective of a :class:`Plan` (module docstring)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        nu: torch.Tensor,
        k: torch.Tensor,
        how: Coefficients,
        layout: Plan,
        *params: torch.Tensor | None,
    ) -> torch.Tensor:
        """The batch mean of the objective."""
        d = nu.shape[1]
        stack = x.new_empty((3, *x.shape))
        stack[0] = x
        torch.sub(x, how.eps, out=stack[1]).clamp_(*how.domain)
        torch.add(x, how.eps, out=stack[2]).clamp_(*how.domain)
        weights = list(params[0::2])
        biases = list(params[1::2])
        t = len(layout.trunk)
        saved = []
        for i, (_, relu) in enumerate(layout.trunk):
            stack, keep = _dense(stack, weights[i], biases[i], relu)  # type: ignore[arg-type]
            saved.append(keep)
        head_w = torch.cat([weights[t], weights[t + 1]])  # type: ignore[list-item]
        head_b = None
        if biases[t] is not None or biases[t + 1] is not None:
            zero = x.new_zeros(d)
            head_b = torch.cat(
                [b if b is not None else zero for b in biases[t : t + 2]]
            )
        heads, keep = _dense(stack, head_w, head_b, False)
        saved.append(keep)
        mu = heads[..., :d]
        raw = heads[0::2, :, d:]
        logvar = raw.clamp(*how.logvar_range)
        outside = logvar != raw
        sigma = logvar.mul(0.5).exp_()
        spread = sigma[1] * k[:, None]
        stack = torch.empty_like(mu)
        torch.addcmul(mu[0], sigma[0], nu, out=stack[0])
        torch.sub(mu[1], spread, out=stack[1])
        torch.add(mu[2], spread, out=stack[2])
        for i, (_, relu) in enumerate(layout.decoder):
            stack, keep = _dense(stack, weights[t + 2 + i], biases[t + 2 + i], relu)  # type: ignore[arg-type]
            saved.append(keep)
        if layout.sigmoid:
            stack.sigmoid_()
        miss = stack - x
        miss[1].neg_()
        squares = miss.square()
        plain = squares[0].sum(dim=1)
        worst = torch.maximum(squares[1], squares[2]).sum(dim=1)
        kl = (mu[0].square() + sigma[0].square() - 1.0 - logvar[0]).sum(dim=1)
        total = plain.mul_(how.plain).add_(worst, alpha=how.robust)
        total.add_(kl, alpha=0.5 * how.kl)
        ctx.save_for_backward(nu, k, stack, miss, squares, mu[0], sigma, outside)
        ctx.layers = (saved, weights, layout, how)  # type: ignore[attr-defined]
        return total.mean()

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[Any, ...]:
        """Gradients of every weight and bias (module docstring)."""
        nu, k, ends, miss, squares, mu, sigma, outside = ctx.saved_tensors  # type: ignore[attr-defined]
        saved, weights, layout, how = ctx.layers  # type: ignore[attr-defined]
        n, d = nu.shape
        scale = float(grad) / n
        side = torch.sub(squares[2], squares[1]).sign_()
        back = torch.empty_like(miss)
        torch.mul(miss[0], 2.0 * how.plain * scale, out=back[0])
        torch.mul(miss[1], side - 1.0, out=back[1])
        torch.mul(miss[2], side + 1.0, out=back[2])
        back[1:].mul_(how.robust * scale)
        if layout.sigmoid:
            back = torch.ops.aten.sigmoid_backward(back, ends)
        grads: list[torch.Tensor | None] = [None] * (2 * len(weights))
        t = len(layout.trunk)
        for i in reversed(range(len(layout.decoder))):
            j = t + 2 + i
            back, grads[2 * j], grads[2 * j + 1] = _dense_back(
                back, weights[j], saved[t + 1 + i], True
            )
        heads = back.new_zeros((3, n, 2 * d))
        heads[..., :d] = back
        heads[0, :, :d].add_(mu, alpha=how.kl * scale)
        torch.mul(back[0], nu, out=heads[0, :, d:])
        heads[0, :, d:].mul_(sigma[0]).add_(
            sigma[0].square() - 1.0, alpha=how.kl * scale
        )
        torch.sub(back[2], back[1], out=heads[2, :, d:]).mul_(k[:, None])
        heads[2, :, d:].mul_(sigma[1])
        heads[0::2, :, d:].mul_(0.5).masked_fill_(outside, 0.0)
        back, head_w, head_b = _dense_back(
            heads, torch.cat([weights[t], weights[t + 1]]), saved[t], t > 0
        )
        grads[2 * t], grads[2 * t + 2] = head_w[:d], head_w[d:]
        grads[2 * t + 1], grads[2 * t + 3] = head_b[:d], head_b[d:]
        for i in reversed(range(t)):
            back, grads[2 * i], grads[2 * i + 1] = _dense_back(
                back, weights[i], saved[i], i > 0
            )
        needs = ctx.needs_input_grad[5:]  # type: ignore[attr-defined]
        grads = [g if need else None for g, need in zip(grads, needs, strict=True)]
        return (None, None, None, None, None, *grads)


def civet_objective(
    layout: Plan,
    params: Sequence[torch.Tensor | None],
    x: torch.Tensor,
    nu: torch.Tensor,
    k: torch.Tensor,
    how: Coefficients,
) -> torch.Tensor:
    """Batch mean of certified training's objective (one autograd node).

    Parameters
    ----------
    layout : Plan
        The container's chains.
    params : sequence of tensors
        ``layout.parameters()`` (read once per training run).
    x : torch.Tensor of shape (n, features)
        Inputs (also the reconstruction target).
    nu : torch.Tensor of shape (n, d)
        The noise of the plain term.
    k : torch.Tensor of shape (n,)
        Each row's support half-width.
    how : Coefficients
        Radius, domain, clamp and mixing weights.
    """
    out: torch.Tensor = CivetObjective.apply(x, nu, k, how, layout, *params)  # type: ignore[no-untyped-call]
    return out
