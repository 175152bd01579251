r"""Harness wiring of CIVET: white-box attacks on a VAE's reconstruction.

The game: a VAE is trained on digits (or on synthetic clusters squashed into
[0, 1]); the adversary reads its parameters and perturbs each evaluation input
within :math:`B_\infty(x, \varepsilon) \cap [0, 1]^n` (and, for the joint attack,
the latent noise inside the level-:math:`p` box :math:`[-k, k]^d`) to maximise the
squared reconstruction error to the clean input. The judge measures the damage
(attacked minus clean error, with common random numbers), checks the attack against
the certificate of the deployed model (a deterministic loss above :math:`U_p`, or an
expected loss provably above the expected-loss bound, is a *violation*) and runs the
Monte-Carlo check of :math:`\Pr_\nu[\ell \le U_p] \ge p` at the attacked inputs.

Every arm is certified the same way (``utility.certified_loss``), so the standard
and PGD-trained VAEs show their (vacuous) certificates next to CIVET's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from defenses.arrays import FloatArray
from defenses.checks import check_choice, check_int, check_real
from defenses.civet import figures
from defenses.civet.arms import (
    ARCHS,
    CivetTraining,
    PGDTraining,
    TrainedVAE,
    VAELearner,
)
from defenses.civet.attacks import (
    EOTPGD,
    JointPGD,
    LatentAttack,
    MaxDamage,
    VAEGuess,
    VAEView,
    fraction_under,
    losses_at,
)
from defenses.civet.benchmark import eps_sweep
from defenses.civet.certificate import certify
from defenses.civet.defense import TrainConfig, TrainSchedule
from defenses.civet.model import sse
from defenses.civet.support import halfwidth
from defenses.civet.tasks import DATASETS, VAETask, load_images
from defenses.data import stratified_split
from defenses.fields import values_of
from defenses.registry import register, register_package
from defenses.results import Result
from defenses.threat import Budget, Capability, ThreatModel

register_package(
    attacks=[JointPGD, EOTPGD, LatentAttack, MaxDamage],
    defenses=[CivetTraining, PGDTraining],
    figures={"civet": figures.draw},
)

TOLERANCE = 1e-6
HOEFFDING_DELTA = 0.01


@register("scenarios", "civet-vae")
@dataclass(frozen=True)
class CivetScenario(TrainSchedule):
    """White-box L-infinity attacks on a VAE's reconstruction.

    Parameters
    ----------
    data : {"digits", "blobs"}
        Data set (``blobs`` is synthetic, see :func:`load_images`).
    arch : {"mlp", "conv", "user-conv", "user-resmlp"}
        VAE architecture: the built-in container as an MLP or convolutional
        ("conv" needs digits), or a user-style module
        (:class:`~defenses.civet.tasks.ConvVAE`, digits only;
        :class:`~defenses.civet.tasks.ResidualMLPVAE`), see
        :class:`~defenses.civet.arms.VAELearner`.
    latent_dim : int
        Latent dimension, >= 1.
    hidden : tuple of int
        Encoder widths (mirrored by the decoder).
    epochs, batch_size, lr, beta, warmup
        Training of every arm (:class:`~defenses.civet.defense.TrainSchedule`).
    eps : float
        Attack radius (L-infinity) in [0, 1]; also the default training radius.
    p : float
        Level of the certificate, in (0, 1).
    train_fraction : float
        Fraction of the data used for training, in (0, 1).
    n_eval : int
        Held-out inputs attacked and certified, >= 1.
    mc_samples : int
        Latent draws per input of the judge's Monte-Carlo estimates, >= 1.
    """

    name: ClassVar[str] = "civet-vae"
    headline: ClassVar[tuple[str, str]] = ("certified_loss", "damage")
    chance: ClassVar[Mapping[str, float]] = {
        "damage": 0.0,
        "violation_rate": 0.0,
        "mc_violation_rate": 0.0,
    }
    data: str = "digits"
    arch: str = "mlp"
    latent_dim: int = 4
    hidden: tuple[int, ...] = (64, 32)
    p: float = 0.95
    train_fraction: float = 0.8
    n_eval: int = 100
    mc_samples: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.hidden, tuple | list) or not self.hidden:
            raise ValueError(
                "CivetScenario.hidden must be a non-empty list of widths, got "
                f"{self.hidden!r}"
            )
        widths = tuple(check_int("CivetScenario.hidden", h, 1) for h in self.hidden)
        object.__setattr__(self, "hidden", widths)
        check_choice("CivetScenario.data", self.data, DATASETS)
        check_choice("CivetScenario.arch", self.arch, ARCHS)
        if self.arch in ("conv", "user-conv") and self.data != "digits":
            raise ValueError(
                f"CivetScenario.arch={self.arch!r} needs data='digits' (images)"
            )
        check_real("CivetScenario.eps", self.eps, 0.0, 1.0)
        for name in ("p", "train_fraction"):
            check_real(
                f"CivetScenario.{name}",
                getattr(self, name),
                0.0,
                1.0,
                open_low=True,
                open_high=True,
            )
        for name in ("n_eval", "mc_samples", "latent_dim"):
            check_int(f"CivetScenario.{name}", getattr(self, name), 1)
        self.train_config()

    def train_config(self) -> TrainConfig:
        """Training hyper-parameters shared by every arm (validated there)."""
        try:
            schedule = values_of(TrainSchedule, self)
            return TrainConfig(**schedule | {"eps": float(self.eps)})
        except ValueError as error:
            raise ValueError(f"CivetScenario: {error}") from error

    @property
    def threat(self) -> ThreatModel:
        """White-box integrity attack on the deployed VAE within an L-inf ball."""
        return ThreatModel.granting(
            "integrity",
            Capability.READ_PARAMETERS,
            budget=Budget(radius=float(self.eps), norm="linf"),
            adaptive=True,
        )

    def setup(self, rng: np.random.Generator) -> VAETask:
        """Split the data; pick the attacked inputs and the judge's seed."""
        X, y = load_images(self.data, rng)
        train_i, test_i = stratified_split(
            y, [self.train_fraction, 1 - self.train_fraction], rng
        )
        if self.n_eval > test_i.size:
            raise ValueError(
                f"CivetScenario.n_eval={self.n_eval} exceeds the {test_i.size} "
                "held-out inputs"
            )
        x_eval = X[rng.permutation(test_i)[: self.n_eval]]
        mean_image = X[train_i].mean(axis=0)
        return VAETask(
            train=X[train_i],
            x_eval=x_eval,
            eps=float(self.eps),
            p=float(self.p),
            image_shape=(8, 8) if self.arch == "conv" else None,
            judge_seed=int(rng.integers(2**62)),
            reference_loss=((x_eval - mean_image) ** 2).sum(axis=1),
        )

    def learner(self) -> VAELearner:
        """The undefended learner: standard VAE training."""
        return VAELearner(
            arch=self.arch,
            latent_dim=self.latent_dim,
            hidden=self.hidden,
            method="standard",
            config=self.train_config(),
        )

    def _noise(self, task: VAETask, salt: int) -> torch.Tensor:
        generator = torch.Generator()
        generator.manual_seed((task.judge_seed + salt) % 2**62)
        shape = (self.mc_samples, task.x_eval.shape[0], self.latent_dim)
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    def utility(self, system: TrainedVAE, task: VAETask) -> dict[str, float]:
        """Clean expected error, the certificate, and the mean-image reference."""
        model = system.model.copy(torch.float64)
        x = torch.as_tensor(task.x_eval)
        clean = losses_at(model, x, x, self._noise(task, 0)).mean(dim=0)
        cert = certify(system.model, task.x_eval, task.eps, task.p)
        return {
            "clean_loss": float(clean.mean()),
            "certified_loss": float(np.mean(cert.bound)),
            "certified_expected_loss": float(np.mean(cert.expected_bound)),
            "mean_image_loss": float(np.mean(task.reference_loss)),
        }

    def expose(
        self, system: TrainedVAE, task: VAETask, known_defense: object | None
    ) -> VAEView:
        """A copy of the model, the inputs to attack and the budget."""
        return VAEView(
            model=system.model.copy(system.model.dtype),
            x=task.x_eval.copy(),
            eps=task.eps,
            k=halfwidth(task.p, system.model.latent_dim),
            p=task.p,
        )

    def _admissible(self, guess: VAEGuess, task: VAETask, k: float) -> FloatArray:
        x_adv = np.asarray(guess.x_adv, dtype=np.float64)
        if x_adv.shape != task.x_eval.shape or not np.all(np.isfinite(x_adv)):
            raise ValueError(
                f"guess.x_adv must be finite with shape {task.x_eval.shape}, "
                f"got {x_adv.shape}"
            )
        step = float(np.max(np.abs(x_adv - task.x_eval)))
        if step > task.eps + TOLERANCE:
            raise ValueError(f"guess.x_adv moves {step:.6g} > eps={task.eps}")
        if x_adv.min() < -TOLERANCE or x_adv.max() > 1 + TOLERANCE:
            raise ValueError("guess.x_adv leaves the input domain [0, 1]")
        if guess.nu is not None:
            nu = np.asarray(guess.nu, dtype=np.float64)
            if nu.shape != (task.x_eval.shape[0], self.latent_dim):
                raise ValueError(
                    f"guess.nu must have shape ({task.x_eval.shape[0]}, "
                    f"{self.latent_dim}), got {nu.shape}"
                )
            if not np.all(np.abs(nu) <= k + TOLERANCE):
                raise ValueError(f"guess.nu leaves the noise box [-{k:.4g}, {k:.4g}]")
        return np.clip(x_adv, 0.0, 1.0)

    def judge(
        self, system: TrainedVAE, task: VAETask, guess: VAEGuess | None
    ) -> dict[str, float]:
        """Damage, attacked error, certificate violations and the MC check."""
        if guess is None:
            raise ValueError("the VAE game needs a guess")
        k = halfwidth(task.p, self.latent_dim)
        x_adv = torch.as_tensor(self._admissible(guess, task, k))
        x = torch.as_tensor(task.x_eval)
        model = system.model.copy(torch.float64)
        cert = certify(system.model, task.x_eval, task.eps, task.p)
        noise = self._noise(task, 1)
        sampled = losses_at(model, x_adv, x, noise)
        if guess.nu is not None:
            nu = torch.as_tensor(np.asarray(guess.nu, dtype=np.float64))
            with torch.no_grad():
                attacked = sse(model.reconstruct(x_adv, nu), x).numpy()
                clean = sse(model.reconstruct(x, nu), x).numpy()
            violated = attacked > cert.bound + TOLERANCE * (1 + cert.bound)
        else:
            attacked = sampled.mean(dim=0).numpy()
            clean = losses_at(model, x, x, noise).mean(dim=0).numpy()
            margin = cert.ceiling * math.sqrt(
                math.log(1 / HOEFFDING_DELTA) / (2 * self.mc_samples)
            )
            violated = attacked - margin > cert.expected_bound
        check = fraction_under(sampled.numpy(), cert.bound, task.p)
        return {
            "damage": float(np.mean(attacked - clean)),
            "attack_loss": float(np.mean(attacked)),
            "bound_tightness": float(np.mean(attacked) / np.mean(cert.bound)),
            "violation_rate": float(np.mean(violated)),
            "mc_violation_rate": float(np.mean(check.violated)),
            "mc_over_rate": float(np.mean(1 - check.under)),
            "mc_over_max": float(np.max(1 - check.under)),
        }

    def random_guess(self, task: VAETask, rng: np.random.Generator) -> VAEGuess:
        """The null perturbation (no damage by construction): the chance level."""
        return VAEGuess(task.x_eval.copy())


def civet_eps(params: Mapping[str, Any], seeds: Sequence[int]) -> Iterator[Result]:
    """The ``civet-eps`` benchmark: the radius sweep on the :class:`CivetScenario`.

    See :func:`defenses.civet.benchmark.eps_sweep` for the parameters.
    """
    return eps_sweep(params, seeds, CivetScenario)


register("benchmarks", "civet-eps")(civet_eps)
