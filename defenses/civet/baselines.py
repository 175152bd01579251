"""Baselines the paper compares CIVET with.

* Standard training is the undefended learner itself (``method="standard"``).
* :class:`PGDTraining`: adversarial training with PGD on the reconstruction loss
  (Madry et al., 2018), the empirical defense CIVET is compared with; it improves
  the attacked error but not the certificate, which :meth:`certify` reports too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from defenses.api import DefenseKind
from defenses.civet.defense import CertifyingTrainer, VAELearner, replace_training


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
    kind: ClassVar[DefenseKind] = DefenseKind.TRAINER
    steps: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.steps, bool)
            or not isinstance(self.steps, int)
            or self.steps < 1
        ):
            raise ValueError(
                f"PGDTraining.steps must be an int >= 1, got {self.steps!r}"
            )

    def wrap(self, learner: VAELearner) -> VAELearner:
        """Return a copy of ``learner`` that trains with ``method="pgd"``."""
        return replace_training(
            learner,
            "pgd",
            "PGDTraining",
            eps=self.eps,
            kappa=self.kappa,
            pgd_steps=self.steps,
        )
