r"""Attacks on a VAE's reconstruction, and the Monte-Carlo check of a certificate.

All attacks are white-box and move the input inside
:math:`B_\infty(x, \varepsilon) \cap [0, 1]^n` by signed-gradient steps (PGD, Madry
et al. 2018), keeping each row's best iterate:

* :class:`JointPGD` also moves the latent noise :math:`\nu` inside
  :math:`[-k, k]^d`, maximising :math:`\ell(D(\mu(x') + \sigma(x')\odot\nu), x)`.
  That is exactly the set the support-set certificate over-approximates, so it is
  the strongest falsifier of :math:`U_p` (a loss above :math:`U_p` is a bug).
* :class:`EOTPGD` maximises :math:`\mathbb E_\nu \ell` with fresh noise at every
  step (expectation over transformation, Athalye et al. 2018).
* :class:`LatentAttack` pulls :math:`q(z \mid x')` towards the posterior of another
  input, minimising :math:`\mathrm{KL}(q(z\mid x') \| q(z\mid x_t))` (Tabacof et al.
  2016; Gondim-Ribeiro et al. 2018).
* :class:`MaxDamage` maximises :math:`\|D(\mu(x')) - D(\mu(x))\|_2^2` (the
  L-infinity version of the maximum-damage attack of Camuto et al., AISTATS 2021).

:func:`mc_check` samples latents at attacked inputs and tests that at least a
fraction :math:`p` of them stays under the certified bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from defenses.arrays import FloatArray
from defenses.checks import check_int, check_real
from defenses.civet.model import sse
from defenses.civet.protocol import VAEInterface, as_vae
from defenses.metrics import clopper_pearson
from defenses.threads import torch_generator, torch_threads
from defenses.threat import Capability

WHITE_BOX = frozenset({Capability.READ_PARAMETERS})


@dataclass(frozen=True)
class VAEView:
    """What a white-box adversary gets: the model, the inputs and its budget.

    Attributes
    ----------
    model : torch.nn.Module or VAEInterface
        The deployed model (a copy; the adversary may read it freely): any module
        of the VAE protocol (:mod:`defenses.civet.protocol`).
    x : ndarray of shape (n, n_features)
        Clean inputs to attack; the loss is measured against them.
    eps : float
        L-infinity radius.
    k : float
        Half-width of the latent-noise box :math:`[-k, k]^d` of the level-``p``
        support (the joint attack may move the noise inside it).
    p : float
        The level the certificate is stated at.
    """

    model: nn.Module | VAEInterface
    x: FloatArray
    eps: float
    k: float
    p: float


@dataclass(frozen=True)
class VAEGuess:
    """Perturbed inputs, and the latent noise if the attack also chose it."""

    x_adv: FloatArray
    nu: FloatArray | None = None


Objective = Callable[[Sequence[torch.Tensor]], torch.Tensor]


def projected_ascent(
    objective: Objective,
    starts: Sequence[torch.Tensor],
    boxes: Sequence[tuple[torch.Tensor, torch.Tensor]],
    step_sizes: Sequence[float],
    steps: int,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Signed-gradient ascent of a per-row objective over a product of boxes.

    Returns each row's best iterate (over all steps, including the start) and the
    objective there.
    """
    current = [s.detach().clone() for s in starts]
    best = [c.clone() for c in current]
    best_value = torch.full((current[0].shape[0],), -torch.inf, dtype=current[0].dtype)
    for step in range(steps + 1):
        for c in current:
            c.requires_grad_(True)
        value = objective(current)
        better = value.detach() > best_value
        best_value = torch.where(better, value.detach(), best_value)
        for b, c in zip(best, current, strict=True):
            b[better] = c.detach()[better]
        if step == steps:
            break
        grads = torch.autograd.grad(value.sum(), current)
        current = [
            torch.minimum(torch.maximum(c.detach() + size * g.sign(), low), high)
            for c, g, size, (low, high) in zip(
                current, grads, step_sizes, boxes, strict=True
            )
        ]
    return best, best_value


def _input_ascent(
    objective: Objective,
    start: torch.Tensor,
    box: tuple[torch.Tensor, torch.Tensor],
    eps: float,
    steps: int,
    threads: int,
) -> VAEGuess:
    """Best input per row in ``box``: :func:`projected_ascent`, step 2.5 eps / steps."""
    with torch_threads(threads):
        (best,), _ = projected_ascent(
            objective, [start], [box], [2.5 * eps / steps], steps
        )
    return VAEGuess(best.double().numpy())


def _ball(
    vae: VAEInterface, eps: float, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    low, high = vae.domain
    return (x - eps).clamp(low, high), (x + eps).clamp(low, high)


def _open(view: VAEView) -> tuple[VAEInterface, torch.Tensor]:
    """The view's model in eval mode, and its validated inputs."""
    vae = as_vae(view.model, view.x)
    vae.module.eval()
    return vae, vae.inputs(view.x)


def _check(owner: str, **values: int) -> None:
    for name, value in values.items():
        check_int(f"{owner}.{name}", value, 1)


@dataclass(frozen=True)
class WhiteBoxPGD:
    """What the attacks share: white-box access, ``steps`` and ``threads``.

    Every field of an attack (these two and a subclass's own counts) is an int
    >= 1, checked at construction and named ``Attack.field`` in the error.

    Parameters
    ----------
    steps : int
        Ascent (or descent) steps, >= 1 (per restart where there are restarts).
    threads : int
        Torch threads while attacking, >= 1.
    """

    requires: ClassVar[frozenset[Capability]] = WHITE_BOX
    steps: int = 50
    threads: int = 1

    def __post_init__(self) -> None:
        _check(
            type(self).__name__,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
        )


@dataclass(frozen=True)
class JointPGD(WhiteBoxPGD):
    """PGD jointly over the input ball and the latent-noise box ``[-k, k]^d``.

    Restart 0 starts at the clean input and a random corner of the noise box; the
    others start uniformly at random in both boxes. ``steps`` and ``threads`` as in
    :class:`WhiteBoxPGD` (step size 2.5 x radius / steps).

    Parameters
    ----------
    restarts : int
        Independent starts, >= 1.
    """

    name: ClassVar[str] = "civet-joint-pgd"
    restarts: int = 2

    def run(self, view: VAEView, rng: np.random.Generator) -> VAEGuess:
        """Return the worst (input, noise) pair found for each row."""
        g = torch_generator(rng)
        model, x = _open(view)
        low, high = _ball(model, view.eps, x)
        shape = (x.shape[0], model.latent_dim)
        nu_low = torch.full(shape, -view.k, dtype=x.dtype)
        nu_high = torch.full(shape, view.k, dtype=x.dtype)

        def objective(v: Sequence[torch.Tensor]) -> torch.Tensor:
            return sse(model.reconstruct(v[0], v[1]), x)

        best_x, best_nu = x.clone(), torch.zeros(shape, dtype=x.dtype)
        best = torch.full((x.shape[0],), -torch.inf, dtype=x.dtype)
        with torch_threads(self.threads):
            for restart in range(self.restarts):
                if restart == 0:
                    corner = torch.randint(0, 2, shape, generator=g).to(x.dtype) * 2 - 1
                    starts = [x, view.k * corner]
                else:
                    starts = [
                        low
                        + (high - low)
                        * torch.rand(x.shape, generator=g, dtype=x.dtype),
                        view.k
                        * (2 * torch.rand(shape, generator=g, dtype=x.dtype) - 1),
                    ]
                (bx, bn), value = projected_ascent(
                    objective,
                    starts,
                    [(low, high), (nu_low, nu_high)],
                    [2.5 * view.eps / self.steps, 2.5 * view.k / self.steps],
                    self.steps,
                )
                better = value > best
                best = torch.where(better, value, best)
                best_x[better], best_nu[better] = bx[better], bn[better]
        return VAEGuess(best_x.double().numpy(), best_nu.double().numpy())


@dataclass(frozen=True)
class EOTPGD(WhiteBoxPGD):
    """PGD on the expected loss, with ``samples`` fresh noise draws per step.

    Parameters
    ----------
    samples : int
        Noise draws averaged per step, >= 1.
    """

    name: ClassVar[str] = "civet-eot-pgd"
    samples: int = 8

    def run(self, view: VAEView, rng: np.random.Generator) -> VAEGuess:
        """Return the input that maximised the estimated expected loss per row."""
        g = torch_generator(rng)
        model, x = _open(view)
        box = _ball(model, view.eps, x)

        def objective(v: Sequence[torch.Tensor]) -> torch.Tensor:
            mu, logvar = model.encode(v[0])
            noise = torch.randn((self.samples, *mu.shape), generator=g, dtype=mu.dtype)
            z = mu[None] + torch.exp(0.5 * logvar)[None] * noise
            recon = model.decode(z.reshape(-1, model.latent_dim))
            targets = x.repeat(self.samples, *([1] * (x.ndim - 1)))
            return sse(recon, targets).reshape(self.samples, -1).mean(0)

        return _input_ascent(objective, x, box, view.eps, self.steps, self.threads)


@dataclass(frozen=True)
class LatentAttack(WhiteBoxPGD):
    r"""Targeted latent-space attack: move the posterior onto another input's.

    Each row's target is another row of the view (a random derangement drawn from
    the attack's generator); the attack minimises the KL divergence between the
    diagonal Gaussians :math:`q(z \mid x')` and :math:`q(z \mid x_t)` (``steps``
    descent steps).
    """

    name: ClassVar[str] = "civet-latent"

    def run(self, view: VAEView, rng: np.random.Generator) -> VAEGuess:
        """Return inputs whose posterior is closest to their targets' posteriors."""
        model, x = _open(view)
        n = x.shape[0]
        shift = int(rng.integers(1, n)) if n > 1 else 0
        order = rng.permutation(n)
        target = torch.empty(n, dtype=torch.long)
        target[order] = torch.as_tensor(np.roll(order, shift))
        with torch.no_grad():
            mu_t, logvar_t = model.encode(x[target])
        box = _ball(model, view.eps, x)

        def objective(v: Sequence[torch.Tensor]) -> torch.Tensor:
            mu, logvar = model.encode(v[0])
            kl = 0.5 * (
                logvar_t
                - logvar
                + (logvar.exp() + (mu - mu_t) ** 2) / logvar_t.exp()
                - 1
            )
            return -kl.sum(dim=1)

        return _input_ascent(objective, x, box, view.eps, self.steps, self.threads)


@dataclass(frozen=True)
class MaxDamage(WhiteBoxPGD):
    r"""Maximum-damage attack on the mean decode.

    Ascends :math:`\|D(\mu(x')) - D(\mu(x))\|^2` from a random start in the ball.
    """

    name: ClassVar[str] = "civet-max-damage"

    def run(self, view: VAEView, rng: np.random.Generator) -> VAEGuess:
        """Return the inputs that moved the mean reconstruction the most."""
        g = torch_generator(rng)
        model, x = _open(view)
        with torch.no_grad():
            reference = model.decode(model.encode(x)[0])
        low, high = _ball(model, view.eps, x)

        def objective(v: Sequence[torch.Tensor]) -> torch.Tensor:
            return sse(model.decode(model.encode(v[0])[0]), reference)

        start = low + (high - low) * torch.rand(x.shape, generator=g, dtype=x.dtype)
        return _input_ascent(
            objective, start, (low, high), view.eps, self.steps, self.threads
        )


@dataclass(frozen=True)
class MCCheck:
    """Per-input outcome of :func:`mc_check`.

    Attributes
    ----------
    under : ndarray of shape (n,)
        Fraction of sampled latents whose loss is at most the bound.
    upper_confidence : ndarray of shape (n,)
        Upper end of the two-sided Clopper-Pearson interval of that fraction.
    violated : ndarray of bool, shape (n,)
        The interval lies entirely below ``p``: evidence the certificate is wrong.
    losses : ndarray of shape (samples, n)
        The sampled losses.
    """

    under: FloatArray
    upper_confidence: FloatArray
    violated: npt.NDArray[np.bool_]
    losses: FloatArray


def losses_at(
    model: VAEInterface,
    x_in: torch.Tensor,
    target: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """Squared errors to ``target`` of each noise draw at ``x_in``.

    ``noise`` has shape (samples, n, d); the result has shape (samples, n).
    """
    with torch.no_grad():
        mu, logvar = model.encode(x_in)
        z = mu[None] + torch.exp(0.5 * logvar)[None] * noise
        recon = model.decode(z.reshape(-1, model.latent_dim))
        recon = recon.reshape(noise.shape[0], *target.shape)
        return ((recon - target[None]) ** 2).flatten(2).sum(dim=2)


def fraction_under(
    losses: FloatArray, bound: FloatArray, p: float, confidence: float = 0.99
) -> MCCheck:
    """Per input, the fraction of sampled losses at most ``bound``, and its test."""
    check_real("p", p, 0.0, 1.0, open_low=True, open_high=True)
    check_real("confidence", confidence, 0.0, 1.0, open_low=True, open_high=True)
    samples = losses.shape[0]
    hits = (losses <= bound[None]).sum(axis=0)
    upper = np.array([clopper_pearson(int(h), samples, confidence)[1] for h in hits])
    return MCCheck(hits / samples, upper, upper < p, losses)


def mc_check(
    model: nn.Module | VAEInterface,
    x: npt.ArrayLike,
    x_adv: npt.ArrayLike,
    bound: npt.ArrayLike,
    p: float,
    samples: int = 256,
    rng: np.random.Generator | torch.Generator | None = None,
    confidence: float = 0.99,
) -> MCCheck:
    r"""Check :math:`\Pr_\nu[\ell \le U_p] \ge p` at attacked inputs by sampling.

    Parameters
    ----------
    model : torch.nn.Module or VAEInterface
        The certified model (any module of the VAE protocol).
    x, x_adv : array-like of shape (n, n_features)
        Clean inputs (the targets) and the attacked inputs.
    bound : array-like of shape (n,)
        Certified :math:`U_p` per input.
    p : float
        Certified level, in (0, 1).
    samples : int
        Latent draws per input, >= 1.
    rng : generator or None
        Source of the draws.
    confidence : float
        Confidence of the two-sided Clopper-Pearson interval, in (0, 1); an input
        fails when the whole interval lies below ``p``.
    """
    check_real("p", p, 0.0, 1.0, open_low=True, open_high=True)
    _check("mc_check", samples=samples)
    vae = as_vae(model, x)
    dtype = vae.dtype
    clean, adv = vae.inputs(x), vae.inputs(x_adv, "x_adv")
    if adv.shape != clean.shape:
        raise ValueError(
            f"x_adv must have shape {tuple(clean.shape)}, got {tuple(adv.shape)}"
        )
    limit = np.asarray(bound)
    if limit.dtype.kind not in "iuf":
        raise TypeError(f"bound must hold real numbers, got dtype {limit.dtype}")
    limit = limit.astype(np.float64)
    if limit.shape != (clean.shape[0],) or not np.all(np.isfinite(limit)):
        raise ValueError(f"bound must be finite with shape ({clean.shape[0]},)")
    generator = torch_generator(rng if rng is not None else torch.Generator())
    noise = torch.randn(
        (samples, clean.shape[0], vae.latent_dim), generator=generator, dtype=dtype
    )
    vae.module.eval()
    losses = losses_at(vae, adv, clean, noise).double().numpy()
    return fraction_under(losses, limit, p, confidence)
