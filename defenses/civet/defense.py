r"""CIVET's trainer: standard, PGD-adversarial, or certified training of a VAE.

Xu, Banerjee, Vasisht, Singh, "Support is All You Need for Certified VAE Training",
ICLR 2025. :func:`train_vae` is the training half of the method (the certificate it
optimises is :func:`defenses.civet.certificate.certify`).

All three minimise a mix of a task term and :math:`\beta\,\mathrm{KL}(q(z\mid x)\,\|
\,N(0, I))`, with the squared reconstruction error :math:`\ell` to the clean input:

* ``standard``: :math:`\ell(D(\mu(x) + \sigma(x)\odot\nu), x)`, one noise draw;
* ``pgd`` (adversarial training, Madry et al. 2018):
  :math:`(1-\kappa_t)\,\ell(x) + \kappa_t\,\ell(x^\star)`, where :math:`x^\star`
  maximises the loss over :math:`B_\infty(x, \varepsilon_t) \cap [0,1]^n` for the
  step's noise draw (signed-gradient PGD with a random start);
* ``civet`` (Xu et al., ICLR 2025): :math:`(1-\kappa_t)\,\ell(x) + \kappa_t
  \sum_j (p_j - p_{j-1})\,U_{p_j}(x; \varepsilon_t)`, the certified bounds over
  nested supports weighted by their probability mass (the layer-cake bound without
  its constant tail).

The radius :math:`\varepsilon_t` and the weight :math:`\kappa_t` stay at 0 for
``warmup`` epochs, then ramp linearly to ``eps`` and ``kappa`` over a fraction
``ramp`` of all steps (the usual IBP-training schedule, Gowal et al. 2018).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from tqdm.auto import tqdm

from defenses.checks import check_choice, check_int, check_real
from defenses.civet.baselines import pgd_inputs
from defenses.civet.bounds import Box
from defenses.civet.certificate import (
    halfwidths,
    sampled_levels,
    sampled_support_bound,
    support_loss_bounds,
    worst_sse,
)
from defenses.civet.model import kl_standard_normal, sse
from defenses.civet.protocol import VAEInterface, as_vae
from defenses.civet.stacked import Coefficients, civet_objective
from defenses.civet.support import check_levels, layer_cake_weights
from defenses.threads import torch_generator, torch_threads

logger = logging.getLogger(__name__)

Method = Literal["standard", "pgd", "civet"]
METHODS: tuple[str, ...] = get_args(Method)


@dataclass(frozen=True)
class TrainSchedule:
    """The training settings every arm of the CIVET game shares.

    The scenario (:class:`defenses.civet.scenario.CivetScenario`) carries them and
    :class:`TrainConfig` extends them.

    Parameters
    ----------
    epochs, batch_size : int
        Passes over the data and mini-batch size, >= 1.
    lr : float
        Adam learning rate, > 0.
    beta : float
        Weight of the KL term, >= 0.
    eps : float
        Training radius (L-infinity) reached at the end of the ramp, >= 0.
    warmup : int
        Epochs of plain training before the ramp starts, >= 0.
    """

    epochs: int = 60
    batch_size: int = 64
    lr: float = 2e-3
    beta: float = 0.05
    eps: float = 0.1
    warmup: int = 5


@dataclass(frozen=True)
class TrainConfig(TrainSchedule):
    """Hyper-parameters of :func:`train_vae`: the :class:`TrainSchedule` and these.

    Parameters
    ----------
    kappa : float
        Weight of the robust / certified term at the end of the ramp, in [0, 1].
    ramp : float
        Fraction of all steps over which eps and kappa ramp up, in (0, 1].
    levels : tuple of float
        Nested support levels of the certified term (strictly increasing, in (0, 1)).
    pgd_steps : int
        Inner PGD steps of adversarial training, >= 1.
    threads : int
        Torch threads used while training, >= 1.
    support_sampling : bool
        If True, the certified term bounds one support level per row, drawn with
        probability proportional to its weight (an unbiased estimate of the
        weighted sum, :func:`~defenses.civet.certificate.sampled_support_bound`):
        the decoder is bounded over the batch once instead of once per level.
        False bounds every level for every row (the exact weighted sum).
    """

    kappa: float = 0.5
    ramp: float = 0.5
    levels: tuple[float, ...] = (0.5, 0.75, 0.9, 0.95)
    pgd_steps: int = 7
    threads: int = 1
    support_sampling: bool = True

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "pgd_steps", "threads"):
            check_int(f"TrainConfig.{name}", getattr(self, name), minimum=1)
        check_int("TrainConfig.warmup", self.warmup, minimum=0)
        check_real("TrainConfig.lr", self.lr, 0.0, open_low=True)
        check_real("TrainConfig.beta", self.beta, 0.0)
        check_real("TrainConfig.eps", self.eps, 0.0)
        check_real("TrainConfig.kappa", self.kappa, 0.0, 1.0)
        check_real("TrainConfig.ramp", self.ramp, 0.0, 1.0, open_low=True)
        if not isinstance(self.levels, tuple | list):
            raise ValueError(
                f"TrainConfig.levels must be a sequence of levels, got {self.levels!r}"
            )
        object.__setattr__(self, "levels", check_levels(tuple(self.levels)))
        if not isinstance(self.support_sampling, bool):
            raise ValueError(
                "TrainConfig.support_sampling must be True or False, got "
                f"{self.support_sampling!r}"
            )


@dataclass(frozen=True)
class TrainLog:
    """What one training run did and how long each epoch took."""

    method: str
    epoch_seconds: tuple[float, ...]
    losses: tuple[float, ...]

    @property
    def seconds_per_epoch(self) -> float:
        """Median wall time of one epoch."""
        return float(np.median(self.epoch_seconds))


def schedule(step: int, steps_per_epoch: int, config: TrainConfig) -> float:
    """Fraction of the final eps and kappa used at ``step`` (0 during warm-up)."""
    total = config.epochs * steps_per_epoch
    start = config.warmup * steps_per_epoch
    length = max(1, round(config.ramp * total))
    return min(1.0, max(0.0, (step - start) / length))


def _objective(
    method: str, vae: VAEInterface, config: TrainConfig, generator: torch.Generator
) -> Callable[[torch.Tensor, float], torch.Tensor]:
    weights = layer_cake_weights(config.levels).to(vae.dtype)
    fast = vae.fused() if method == "civet" and config.support_sampling else None
    layout = fast.plan if fast is not None else None
    params = layout.parameters() if layout is not None else []
    total = float(weights.sum())
    ks = halfwidths(config.levels, vae.latent_dim, vae.dtype)

    def fused(x: torch.Tensor, frac: float) -> torch.Tensor:
        """The civet loss in one fused pass (built-in MLP container only)."""
        kappa, eps = config.kappa * frac, config.eps * frac
        nu = torch.randn((x.shape[0], vae.latent_dim), generator=generator)
        level = sampled_levels(weights, x.shape[0], generator)
        if layout is not None:
            how = Coefficients(
                eps,
                vae.domain,
                layout.model.logvar_range,
                1 - kappa,
                kappa * total,
                config.beta,
            )
            return civet_objective(layout, params, x, nu.to(x.dtype), ks[level], how)
        ball = Box.linf_ball(x, eps, vae.domain)
        recon, mu, logvar, out = fast.training_terms(  # type: ignore[union-attr]
            x, nu.to(x.dtype), ball, ks[level]
        )
        plain = sse(recon, x)
        robust = weights.sum() * worst_sse(out, x)
        kl = kl_standard_normal(mu, logvar)
        return ((1 - kappa) * plain + kappa * robust + config.beta * kl).mean()

    def loss(x: torch.Tensor, frac: float) -> torch.Tensor:
        if fast is not None and frac > 0.0 and config.kappa > 0.0:
            return fused(x, frac)
        mu, logvar = vae.encode(x)
        nu = torch.randn(mu.shape, generator=generator, dtype=mu.dtype)
        plain = sse(vae.decode(mu + torch.exp(0.5 * logvar) * nu), x)
        kl = kl_standard_normal(mu, logvar)
        kappa, eps = config.kappa * frac, config.eps * frac
        if method == "standard" or kappa == 0.0:
            return (plain + config.beta * kl).mean()
        if method == "pgd":
            adv = pgd_inputs(vae, x, nu, eps, config.pgd_steps, generator)
            robust = sse(vae.reconstruct(adv, nu), x)
        elif config.support_sampling:
            robust = sampled_support_bound(
                vae, x, eps, config.levels, weights, generator
            )
        else:
            bounds = support_loss_bounds(vae, x, x, eps, config.levels)
            robust = (weights[:, None] * bounds).sum(dim=0)
        return ((1 - kappa) * plain + kappa * robust + config.beta * kl).mean()

    return loss


def run_epoch(
    objective: Callable[[torch.Tensor, float], torch.Tensor],
    optimiser: torch.optim.Optimizer,
    data: torch.Tensor,
    batch_size: int,
    generator: torch.Generator,
    fraction: Callable[[int], float],
    step: int,
) -> tuple[float, int]:
    """One pass over ``data`` in a random order, one Adam step per mini-batch.

    ``fraction(step)`` is the share of the final radius and weight at each step.
    Returns the loss summed over the rows and the next step's index.
    """
    n = data.shape[0]
    order = torch.randperm(n, generator=generator)
    total = 0.0
    for i in range(math.ceil(n / batch_size)):
        batch = data[order[i * batch_size : (i + 1) * batch_size]]
        loss = objective(batch, fraction(step))
        optimiser.zero_grad()
        torch.autograd.backward([loss])
        optimiser.step()
        total += float(loss.detach()) * batch.shape[0]
        step += 1
    return total, step


def epoch_ratio(
    vae: VAEInterface,
    X: torch.Tensor | npt.ArrayLike,
    method: Method,
    config: TrainConfig,
    rounds: int = 5,
) -> tuple[float, float]:
    """Cost of an epoch of ``method`` over an epoch of standard training.

    Both train copies of ``vae``'s module on the same rows with the robust term
    fully on (the end of the ramp), one epoch each, alternated for ``rounds``
    rounds after one untimed epoch each, so both see the same machine load.

    Returns
    -------
    (wall, cpu) : float
        Medians over the rounds of the ratio of wall times and of this thread's
        CPU times.
    """
    check_choice("method", method, METHODS)
    check_int("rounds", rounds, 1)
    arms = []
    for name in ("standard", method):
        twin = as_vae(
            copy.deepcopy(vae.module),
            X,
            vae.encode_name,
            vae.decode_name,
            vae.domain,
        )
        generator = torch.Generator().manual_seed(0)
        optimiser = torch.optim.Adam(twin.module.parameters(), lr=config.lr)
        step = functools.partial(
            run_epoch,
            _objective(name, twin, config, generator),
            optimiser,
            twin.inputs(X, "X"),
            config.batch_size,
            generator,
            lambda s: 1.0,
            0,
        )
        twin.module.train()
        arms.append(step)
    wall: list[list[float]] = [[], []]
    cpu: list[list[float]] = [[], []]
    with torch_threads(config.threads):
        for i in range(rounds + 1):
            for arm, run in enumerate(arms):
                began, ticks = time.perf_counter(), time.thread_time()
                run()
                if i:
                    wall[arm].append(time.perf_counter() - began)
                    cpu[arm].append(time.thread_time() - ticks)
    return (
        float(np.median(np.divide(wall[1], wall[0]))),
        float(np.median(np.divide(cpu[1], cpu[0]))),
    )


def train_vae(
    model: nn.Module | VAEInterface,
    X: torch.Tensor | npt.ArrayLike,
    method: Method = "civet",
    config: TrainConfig | None = None,
    rng: np.random.Generator | torch.Generator | None = None,
    progress: bool = True,
    *,
    encode: str = "encode",
    decode: str = "decode",
    domain: tuple[float, float] | None = None,
) -> TrainLog:
    """Train ``model`` in place on the rows of ``X`` with ``method``.

    The certified term of ``method="civet"`` is bounded with the module in eval
    mode (BatchNorm uses its running statistics, Dropout is the identity: the
    function :func:`~defenses.civet.certificate.certify` bounds); the plain term
    runs in training mode.

    Parameters
    ----------
    model : torch.nn.Module or VAEInterface
        Any module with ``encode(x) -> (mu, logvar)`` and ``decode(z) -> x_hat``
        (:mod:`defenses.civet.protocol`); its parameters are updated in place.
    X : array-like of shape (n, *input_shape)
        Training inputs inside the input domain.
    method : {"standard", "pgd", "civet"}
        Training objective (see the module docstring).
    config : TrainConfig or None
        Hyper-parameters (defaults if None).
    rng : numpy or torch generator, or None
        Source of all randomness (batch order, noise, PGD starts); same state, same
        model, bit for bit. None means a fresh unseeded generator.
    progress : bool
        Show a progress bar over epochs (hidden when output is not a terminal).
    encode, decode : str
        Names of the model's two methods.
    domain : (float, float) or None
        Valid input range (None: the model's ``domain`` attribute, else [0, 1]).

    Returns
    -------
    TrainLog
        Per-epoch wall time and mean training objective.
    """
    check_choice("method", method, METHODS)
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    cfg = config or TrainConfig()
    vae = as_vae(model, X, encode, decode, domain)
    data = vae.inputs(X, "X")
    generator = torch_generator(rng if rng is not None else torch.Generator())
    objective = _objective(method, vae, cfg, generator)
    module = vae.module
    optimiser = torch.optim.Adam(module.parameters(), lr=cfg.lr)
    n = data.shape[0]
    per_epoch = math.ceil(n / cfg.batch_size)
    seconds: list[float] = []
    losses: list[float] = []
    step = 0
    module.train()
    with torch_threads(cfg.threads):
        bar = tqdm(range(cfg.epochs), disable=None if progress else True, leave=False)
        for _ in bar:
            start = time.perf_counter()
            total, step = run_epoch(
                objective,
                optimiser,
                data,
                cfg.batch_size,
                generator,
                lambda s: schedule(s, per_epoch, cfg),
                step,
            )
            seconds.append(time.perf_counter() - start)
            losses.append(total / n)
            bar.set_postfix_str(f"{method} loss={losses[-1]:.3f}")
    module.eval()
    if not math.isfinite(losses[-1]):
        raise FloatingPointError(f"{method} training diverged (loss {losses[-1]})")
    logger.info(
        "%s training: %.4f s/epoch, final loss %.4f",
        method,
        np.median(seconds),
        losses[-1],
    )
    return TrainLog(method, tuple(seconds), tuple(losses))
