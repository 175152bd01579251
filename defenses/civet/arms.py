r"""Harness arms of CIVET: the VAE learner and the training defenses that wrap it.

The undefended system is a :class:`VAELearner` with ``method="standard"``; a
defense returns a copy of it that trains differently:

* :class:`CivetTraining`: certified training (Xu, Banerjee, Vasisht, Singh, "Support
  is All You Need for Certified VAE Training", ICLR 2025), ``method="civet"``;
* :class:`PGDTraining`: PGD adversarial training (Madry et al., 2018), the
  empirical baseline the paper compares with, ``method="pgd"``.

Both certify the fitted system the same way, so the baseline reports its (vacuous)
certificate too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch import nn

from defenses.api import DefenseKind
from defenses.arrays import FloatArray
from defenses.checks import check_choice, check_int, check_real
from defenses.civet.certificate import Certificate, certify
from defenses.civet.defense import (
    METHODS,
    Method,
    TrainConfig,
    TrainLog,
    epoch_ratio,
    train_vae,
)
from defenses.civet.model import conv_vae, mlp_vae
from defenses.civet.protocol import VAEInterface, as_vae
from defenses.civet.support import check_levels
from defenses.civet.tasks import USER_ARCHS, user_vae
from defenses.cost import count
from defenses.threads import torch_generator

ARCHS = ("mlp", "conv", *USER_ARCHS)


class VAETaskLike(Protocol):
    """What a learner needs from a task: training rows and, for conv, their shape."""

    @property
    def train(self) -> FloatArray:
        """Training inputs, shape (n, n_features), in [0, 1]."""
        ...

    @property
    def image_shape(self) -> tuple[int, int] | None:
        """Image height and width if the rows are flattened images."""
        ...


@dataclass(frozen=True)
class TrainedVAE:
    """A fitted system: the VAE, how it was trained, and its training log."""

    model: VAEInterface
    method: str
    log: TrainLog


@dataclass(frozen=True)
class VAELearner:
    """Build a VAE and train it on ``task.train`` with ``method``.

    Parameters
    ----------
    arch : {"mlp", "conv", "user-conv", "user-resmlp"}
        The built-in container as an MLP or the small convolutional one (needs
        ``task.image_shape``), or a user-style module of
        :mod:`defenses.civet.tasks` (:class:`~defenses.civet.tasks.ConvVAE`,
        :class:`~defenses.civet.tasks.ResidualMLPVAE`).
    latent_dim : int
        Latent dimension, >= 1.
    hidden : tuple of int
        MLP widths (for the others, the last one is the dense width; for
        "user-resmlp" the number of entries is the number of residual blocks).
    method : {"standard", "pgd", "civet"}
        Training objective.
    config : TrainConfig
        Training hyper-parameters.
    ratio_rounds : int
        Alternated rounds of :func:`~defenses.civet.defense.epoch_ratio` after a
        PGD or CIVET fit (0 skips the measurement).
    """

    arch: str = "mlp"
    latent_dim: int = 4
    hidden: tuple[int, ...] = (64, 32)
    method: Method = "standard"
    config: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    ratio_rounds: int = 5

    def __post_init__(self) -> None:
        check_choice("VAELearner.arch", self.arch, ARCHS)
        check_int("VAELearner.ratio_rounds", self.ratio_rounds, 0)
        check_choice("VAELearner.method", self.method, METHODS)
        check_int("VAELearner.latent_dim", self.latent_dim, 1)

    def build(self, task: VAETaskLike, generator: torch.Generator) -> nn.Module:
        """A freshly initialised VAE for the task's input size."""
        n_features = int(task.train.shape[1])
        if self.arch in USER_ARCHS:
            return user_vae(
                self.arch, n_features, self.latent_dim, self.hidden, generator
            )
        if self.arch == "mlp":
            return mlp_vae(n_features, self.latent_dim, self.hidden, generator)
        if task.image_shape is None:
            raise ValueError("VAELearner.arch='conv' needs a task with an image_shape")
        return conv_vae(
            task.image_shape,
            self.latent_dim,
            hidden=self.hidden[-1],
            generator=generator,
        )

    def fit(self, task: VAETaskLike, rng: np.random.Generator) -> TrainedVAE:
        """Initialise and train a VAE using only the randomness of ``rng``.

        Inside a harness run, records ``epoch_s``: the median wall time of the
        epochs after the warm-up (where PGD and CIVET training add their robust
        term), so a benchmark shows each arm's cost per epoch side by side; a PGD
        or CIVET learner also records ``epoch_ratio`` (wall) and
        ``epoch_ratio_cpu``, its epoch over a standard epoch measured alternated
        on copies of the trained model (:func:`~defenses.civet.defense.
        epoch_ratio`), which a loaded machine cannot skew the way it skews runs
        minutes apart.
        """
        generator = torch_generator(rng)
        vae = as_vae(self.build(task, generator), task.train)
        log = train_vae(vae, task.train, self.method, self.config, generator)
        active = log.epoch_seconds[self.config.warmup :] or log.epoch_seconds
        count("epoch_s", float(np.median(active)))
        if self.method != "standard" and self.ratio_rounds:
            wall, cpu = epoch_ratio(
                vae, task.train, self.method, self.config, self.ratio_rounds
            )
            count("epoch_ratio", wall)
            count("epoch_ratio_cpu", cpu)
        return TrainedVAE(vae, self.method, log)


def certificate_metrics(
    certificate: Certificate, reference: FloatArray | None = None
) -> dict[str, float]:
    """Summary numbers of a certificate (means over inputs).

    ``reference`` (per-input loss of a trivial predictor, e.g. the mean image)
    adds the fraction of inputs certified below it.
    """
    out = {
        "bound": float(np.mean(certificate.bound)),
        "bound_max": float(np.max(certificate.bound)),
        "expected_bound": float(np.mean(certificate.expected_bound)),
        "ceiling": float(np.mean(certificate.ceiling)),
        "eps": certificate.eps,
        "p": certificate.p,
        "k": certificate.k,
    }
    if reference is not None:
        out["below_reference_rate"] = float(np.mean(certificate.bound < reference))
    return out


class CertifiedTask(Protocol):
    """What :meth:`CivetTraining.certify` needs from a task."""

    @property
    def x_eval(self) -> FloatArray:
        """Inputs to certify."""
        ...

    @property
    def eps(self) -> float:
        """Radius of the threat model."""
        ...

    @property
    def p(self) -> float:
        """Probability level."""
        ...

    @property
    def reference_loss(self) -> FloatArray:
        """Per-input loss of the mean-image predictor."""
        ...


def replace_training(
    learner: Any, method: Method, owner: str, **changes: Any
) -> VAELearner:
    """A copy of ``learner`` training with ``method`` and the non-None ``changes``.

    Raises
    ------
    TypeError
        If ``learner`` is not a :class:`VAELearner` (``owner`` names the defense).
    """
    if not isinstance(learner, VAELearner):
        raise TypeError(
            f"{owner}.wrap needs a VAELearner, got {type(learner).__name__}"
        )
    kept = {k: v for k, v in changes.items() if v is not None}
    config = dataclasses.replace(learner.config, **kept)
    return dataclasses.replace(learner, method=method, config=config)


@dataclass(frozen=True)
class CertifyingTrainer:
    """Shared parts of the training defenses: validation, wrapping, certification.

    A subclass names its training ``method`` and, in ``config_fields``, which of
    its fields set which :class:`~defenses.civet.defense.TrainConfig` fields
    (besides ``eps`` and ``kappa``).
    """

    kind: ClassVar[DefenseKind] = DefenseKind.TRAINER
    method: ClassVar[Method]
    config_fields: ClassVar[dict[str, str]]
    eps: float | None = None
    kappa: float = 0.5

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.eps is not None:
            check_real(f"{name}.eps", self.eps, 0.0)
        check_real(f"{name}.kappa", self.kappa, 0.0, 1.0)

    def wrap(self, learner: VAELearner) -> VAELearner:
        """Return a copy of ``learner`` that trains with this defense's ``method``.

        Its config takes ``eps`` (unless None), ``kappa`` and the ``config_fields``.
        """
        changes = {to: getattr(self, mine) for mine, to in self.config_fields.items()}
        return replace_training(
            learner,
            self.method,
            type(self).__name__,
            eps=self.eps,
            kappa=self.kappa,
            **changes,
        )

    def certify(self, system: TrainedVAE, task: CertifiedTask) -> dict[str, float]:
        """Certified bounds of the fitted VAE at the task's radius and level."""
        result = certify(system.model, task.x_eval, task.eps, task.p)
        return certificate_metrics(result, task.reference_loss)


@dataclass(frozen=True)
class CivetTraining(CertifyingTrainer):
    """Certified training of the VAE (CIVET), and its certificate.

    Parameters
    ----------
    eps : float or None
        Training radius; None keeps the learner's (the scenario sets it to the
        threat model's radius).
    kappa : float
        Final weight of the certified term, in [0, 1]: larger gives tighter
        certificates and worse clean reconstructions.
    levels : tuple of float
        Nested support levels of the certified term.
    """

    name: ClassVar[str] = "civet-train"
    method: ClassVar[Method] = "civet"
    config_fields: ClassVar[dict[str, str]] = {"levels": "levels"}
    levels: tuple[float, ...] = (0.5, 0.75, 0.9, 0.95)

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            object.__setattr__(self, "levels", check_levels(tuple(self.levels)))
        except (TypeError, ValueError) as error:
            raise ValueError(f"CivetTraining.levels: {error}") from error


@dataclass(frozen=True)
class PGDTraining(CertifyingTrainer):
    """PGD adversarial training of the VAE.

    Parameters
    ----------
    eps : float or None
        Training radius; None keeps the learner's.
    kappa : float
        Final weight of the adversarial loss, in [0, 1].
    steps : int
        Inner PGD steps, >= 1.
    """

    name: ClassVar[str] = "civet-pgd-train"
    method: ClassVar[Method] = "pgd"
    config_fields: ClassVar[dict[str, str]] = {"steps": "pgd_steps"}
    steps: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("PGDTraining.steps", self.steps, 1)
