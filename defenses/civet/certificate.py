r"""Certified bounds on a VAE's reconstruction error under L-infinity attacks.

For an input :math:`x`, radius :math:`\varepsilon` and level :math:`p`, the
certificate :math:`U_p(x)` satisfies

.. math::  \forall x' \in B_\infty(x, \varepsilon) \cap [0, 1]^n:\quad
           \Pr_\nu\big[\ell(D(\mu(x') + \sigma(x') \odot \nu), x) \le U_p(x)\big]
           \ge p,

with :math:`\ell` the sum of squared errors to the clean input. It is computed as in
CIVET (Xu, Banerjee, Vasisht, Singh, "Support is All You Need for Certified VAE
Training", ICLR 2025): interval bounds of :math:`\mu` and :math:`\sigma` over the
input ball, the box support :math:`S_p` of :mod:`defenses.civet.support`, interval
bounds of the decoder over :math:`S_p`, and the exact worst case of the squared error
over the output box, :math:`\sum_i \max((o^u_i - y_i)^2, (y_i - o^l_i)^2)`.
Nested supports give a bound on the worst-case *expected* loss as well.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy.typing as npt
import torch
from torch import nn

from defenses.arrays import FloatArray
from defenses.checks import check_choice, check_real
from defenses.civet.bounds import Box, UnsupportedLayerError
from defenses.civet.crosscheck import CheckConfig, CheckReport, cross_check
from defenses.civet.crown import crown
from defenses.civet.model import VAE
from defenses.civet.protocol import VAEInterface, as_vae
from defenses.civet.support import (
    check_levels,
    exact_halfwidths,
    expected_bound,
    halfwidth,
)
from defenses.cost import count, phase

DEFAULT_LEVELS: tuple[float, ...] = (0.5, 0.75, 0.9, 0.95, 0.99)


RELAXATIONS = ("ibp", "crown")
CHECK = CheckConfig()


def latent_bounds(
    vae: VAEInterface, box: Box, relaxation: str = "ibp"
) -> tuple[Box, torch.Tensor]:
    """Bounds of the mean and the upper bound of sigma over ``box``.

    ``relaxation="crown"`` needs the built-in :class:`~defenses.civet.model.VAE`
    with ReLU MLP parts (its log-variance clamp is applied to the bound).
    """
    if relaxation == "ibp":
        mu, logvar = vae.latent_bounds(box)
        return mu, torch.exp(0.5 * logvar.upper)
    model = _container(vae)
    mu = crown(nn.Sequential(model.trunk, model.mu_head), box)
    logvar = crown(nn.Sequential(model.trunk, model.logvar_head), box)
    return mu, torch.exp(0.5 * logvar.upper.clamp(*model.logvar_range))


def _container(vae: VAEInterface) -> VAE:
    if not isinstance(vae.module, VAE):
        raise UnsupportedLayerError(
            "relaxation='crown' supports the built-in VAE container with ReLU MLP "
            f"parts, not {type(vae.module).__name__}; use relaxation='ibp'"
        )
    return vae.module


def output_bounds(vae: VAEInterface, box: Box, relaxation: str = "ibp") -> Box:
    """Bounds of the reconstruction over the latent ``box``."""
    if relaxation == "ibp":
        return vae.output_bounds(box)
    return crown(_container(vae).decoder, box)


def worst_sse(out: Box, target: torch.Tensor) -> torch.Tensor:
    """Exact maximum of the squared error to ``target`` over the output box, per row."""
    worst = torch.maximum((out.upper - target) ** 2, (target - out.lower) ** 2)
    return worst.reshape(worst.shape[0], -1).sum(dim=1)


SUPPORTS = ("uniform", "exact")


def _halfwidths(
    mu: Box,
    sigma_upper: torch.Tensor,
    levels: Sequence[float],
    latent_dim: int,
    support: str,
) -> torch.Tensor:
    """Half-widths per level, broadcastable to ``(levels, n, d)``."""
    if support == "uniform":
        return torch.tensor(
            [halfwidth(q, latent_dim) for q in levels], dtype=sigma_upper.dtype
        )[:, None, None]
    if support == "exact":
        spread = ((mu.upper - mu.lower) / sigma_upper).detach()
        return torch.stack([exact_halfwidths(spread, q, latent_dim) for q in levels])
    raise ValueError(f"support must be one of {SUPPORTS}, got {support!r}")


def support_loss_bounds(
    vae: VAEInterface,
    x: torch.Tensor,
    target: torch.Tensor,
    eps: float,
    levels: Sequence[float],
    relaxation: str = "ibp",
    support: str = "uniform",
) -> torch.Tensor:
    """Bounds :math:`U_{p_j}(x)` for each support level, shape ``(len(levels), n)``.

    Differentiable in the model's parameters (used by certified training, with
    IBP). The decoder is bounded once over all levels stacked along the batch.
    """
    box = Box.linf_ball(x, eps, vae.domain)
    mu, sigma_upper = latent_bounds(vae, box, relaxation)
    ks = _halfwidths(mu, sigma_upper, levels, vae.latent_dim, support)
    lower = (mu.lower[None] - ks * sigma_upper[None]).reshape(-1, vae.latent_dim)
    upper = (mu.upper[None] + ks * sigma_upper[None]).reshape(-1, vae.latent_dim)
    out = output_bounds(vae, Box(lower, upper), relaxation)
    stacked = target.repeat(len(levels), *([1] * (target.ndim - 1)))
    return worst_sse(out, stacked).reshape(len(levels), x.shape[0])


def sampled_levels(
    weights: torch.Tensor, n: int, generator: torch.Generator
) -> torch.Tensor:
    r"""One support level per row, :math:`\Pr[J_i = j] = w_j / \sum_k w_k`.

    Systematic sampling over a random order of the rows: every level gets its
    share of each batch, and each row's level has exactly the stated law.
    """
    edges = torch.cumsum(weights / weights.sum(), 0).to(torch.float64)
    order = torch.randperm(n, generator=generator)
    offset = torch.rand((), generator=generator, dtype=torch.float64)
    position = (order.to(torch.float64) + offset) / n
    level = torch.searchsorted(edges, position, right=True)
    return level.clamp(max=weights.shape[0] - 1)


def sampled_support_bound(
    vae: VAEInterface,
    x: torch.Tensor,
    eps: float,
    levels: Sequence[float],
    weights: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    r"""An unbiased one-level estimate of :math:`\sum_j w_j U_{p_j}(x_i)` per row.

    Row :math:`i` gets one level :math:`J_i` with :math:`\Pr[J_i = j] = w_j / W`,
    :math:`W = \sum_j w_j` (:func:`sampled_levels`), and the estimate is
    :math:`W\,U_{p_{J_i}}(x_i)`, whose expectation is the weighted sum. The decoder
    is bounded over ``n`` rows instead of ``len(levels) * n`` (certified training's
    cost; the certificate itself, :func:`certify`, bounds every level exactly).
    """
    level = sampled_levels(weights, x.shape[0], generator)
    ks = halfwidths(levels, vae.latent_dim, x.dtype)[level]
    box = Box.linf_ball(x, eps, vae.domain)
    mu, sigma_upper = latent_bounds(vae, box)
    spread = ks[:, None] * sigma_upper
    out = output_bounds(vae, Box(mu.lower - spread, mu.upper + spread))
    return weights.sum().to(x.dtype) * worst_sse(out, x)


def halfwidths(
    levels: Sequence[float], latent_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """The uniform half-width :math:`k` of each level, as a tensor."""
    return torch.tensor([halfwidth(q, latent_dim) for q in levels], dtype=dtype)


def loss_ceiling(vae: VAEInterface, target: torch.Tensor) -> torch.Tensor:
    """Largest squared error any output can reach, per row (inf if unbounded)."""
    bounded = vae.output_range()
    if bounded is None:
        return torch.full((target.shape[0],), float("inf"), dtype=target.dtype)
    low, high = bounded
    worst = torch.maximum((high - target) ** 2, (target - low) ** 2)
    return worst.reshape(worst.shape[0], -1).sum(dim=1)


@dataclass(frozen=True)
class Certificate:
    """Per-input certified bounds.

    Attributes
    ----------
    bound : ndarray of shape (n,)
        :math:`U_p(x)`: with probability at least ``p`` over the latent noise, the
        squared reconstruction error of every admissible perturbation is at most
        this.
    expected_bound : ndarray of shape (n,)
        Bound on the worst-case expected squared error (nested supports at
        ``levels``; ``inf`` if the decoder's output is unbounded).
    ceiling : ndarray of shape (n,)
        Largest squared error any output can reach (the vacuous bound).
    latent_lower, latent_upper : ndarray of shape (n, d)
        The support box :math:`S_p`.
    eps, p, k : float
        Radius, level and the uniform support half-width in noise units (the
        exact support uses per-dimension half-widths no larger than this).
    levels : tuple of float
        Support levels of the expected-loss bound.
    seconds : float
        Wall time of the bounds (protocol check, copy, propagation).
    check : CheckReport
        The cross-check against the module that the certificate passed
        (:mod:`defenses.civet.crosscheck`); its ``seconds`` are the check's cost.
        Inside a harness run both times are also recorded as costs,
        ``certify_bounds_s`` and ``certify_check_s`` (with ``certify_check_cpu_s``).
    """

    bound: FloatArray
    expected_bound: FloatArray
    ceiling: FloatArray
    latent_lower: FloatArray
    latent_upper: FloatArray
    eps: float
    p: float
    k: float
    levels: tuple[float, ...]
    seconds: float
    check: CheckReport


def certify(
    model: nn.Module | VAEInterface,
    x: torch.Tensor | npt.ArrayLike,
    eps: float,
    p: float = 0.95,
    levels: Sequence[float] = DEFAULT_LEVELS,
    relaxation: str = "ibp",
    support: str = "uniform",
    *,
    encode: str = "encode",
    decode: str = "decode",
    domain: tuple[float, float] | None = None,
    check: CheckConfig = CHECK,
) -> Certificate:
    r"""Certify the reconstruction error of ``model`` around each row of ``x``.

    Bounds are computed in float64 on an eval-mode copy of the model: what is
    certified is the eval-mode function (BatchNorm with its running statistics,
    Dropout off), whatever mode the model is in. Before it is returned, the
    certificate is cross-checked against the module itself
    (:func:`~defenses.civet.crosscheck.cross_check`: the traced graph against the
    module at the centre, the bound against the module's error at sampled points of
    the input ball and the noise boxes and at the best point of a short joint
    attack); any disagreement raises :class:`~defenses.civet.crosscheck.
    CrossCheckError` instead of returning a number.

    Parameters
    ----------
    model : torch.nn.Module or VAEInterface
        Any module with ``encode(x) -> (mu, logvar)`` and ``decode(z) -> x_hat``
        (:mod:`defenses.civet.protocol`), e.g. the built-in
        :class:`~defenses.civet.model.VAE`; left unchanged.
    x : array-like of shape (n, *input_shape)
        Clean inputs inside the input domain; they are also the targets.
    eps : float
        L-infinity radius, >= 0.
    p : float
        Probability level in (0, 1).
    levels : sequence of float
        Support levels for the expected-loss bound (``p`` is added).
    relaxation : {"ibp", "crown"}
        Interval bound propagation through the traced graph, or the CROWN-IBP
        linear relaxation of :mod:`defenses.civet.crown` (tighter; the built-in
        container with ReLU MLPs only).
    support : {"uniform", "exact"}
        Box support with one half-width ``k`` in noise units for every latent
        dimension (the set the joint attack searches), or the smallest sound
        half-width per dimension given the encoder bounds
        (:func:`~defenses.civet.support.exact_halfwidths`; never larger).
    encode, decode : str
        Names of the model's two methods.
    domain : (float, float) or None
        Valid input range (None: the model's ``domain`` attribute, else [0, 1]).
    check : CheckConfig
        Size of the cross-check (sampled points per row, attack steps, tolerance,
        seed); it always runs.

    Raises
    ------
    TypeError
        If ``model`` does not follow the protocol (the message says how).
    ValueError
        For ``eps < 0``, ``p`` outside (0, 1), NaN inputs or inputs outside the
        domain, or bad levels.
    UnsupportedLayerError
        If the model holds an operation the chosen relaxation has no rule for.
    CrossCheckError
        If the certificate disagrees with the module (the message names the first
        disagreement: row, point, error and bound).
    """
    check_choice("relaxation", relaxation, RELAXATIONS)
    check_choice("support", support, SUPPORTS)
    if not isinstance(check, CheckConfig):
        raise TypeError(f"check must be a CheckConfig, got {type(check).__name__}")
    eps = check_real("eps", eps, 0.0)
    p = check_real("p", p, 0.0, 1.0, open_low=True, open_high=True)
    every = tuple(sorted(set(check_levels(levels)) | {p}))
    began = time.perf_counter()
    vae = as_vae(model, x, encode, decode, domain)
    exact = vae.copy(torch.float64)
    inputs = exact.inputs(x)
    with torch.no_grad():
        bounds = support_loss_bounds(
            exact, inputs, inputs, eps, every, relaxation, support
        )
        ceiling = loss_ceiling(exact, inputs)
        # an overflow inside the propagation (inf - inf) falls back to the ceiling
        bounds = torch.where(torch.isnan(bounds), ceiling, bounds)
        bounds = torch.minimum(torch.cummax(bounds, dim=0).values, ceiling)
        expected = expected_bound(every, bounds, ceiling)
        ball = Box.linf_ball(inputs, eps, vae.domain)
        mu, sigma_upper = latent_bounds(exact, ball, relaxation)
        widths = _halfwidths(mu, sigma_upper, every, vae.latent_dim, support)
        widths = widths.expand(len(every), *mu.lower.shape)
    seconds = time.perf_counter() - began
    index = every.index(p)
    count("certify_bounds_s", seconds)
    with phase("certify_check"):
        report = cross_check(
            exact, vae, inputs, eps, every, bounds, ceiling, widths, index, check
        )
    latent = Box(
        mu.lower - widths[index] * sigma_upper, mu.upper + widths[index] * sigma_upper
    )
    return Certificate(
        bound=bounds[index].numpy(),
        expected_bound=expected.numpy(),
        ceiling=ceiling.numpy(),
        latent_lower=latent.lower.numpy(),
        latent_upper=latent.upper.numpy(),
        eps=eps,
        p=p,
        k=halfwidth(p, vae.latent_dim),
        levels=every,
        seconds=seconds,
        check=report,
    )
