"""The defenses: CKKS encryption of the uploads, and an embedding-noise baseline.

The Gaussian embedding noise is the non-cryptographic alternative.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from defenses.api import DefenseKind
from defenses.checks import check_real

from .arms import EncryptedDeployment, EncryptedLearner, NoisyLearner
from .he.ckks import HE_STANDARD_128, INTERACTIVE, CKKSParams


@dataclass(frozen=True)
class CKKSDefense:
    """Serve the personalised model under CKKS (Rho et al., 2025).

    Parameters
    ----------
    poly_modulus_degree : int
        Ring dimension N.
    coeff_mod_bit_sizes : list of int
        The modulus chain (checked against the 128-bit HE standard).
    scale_bits : int
        log2 of the CKKS scale.
    interactive : bool
        Client-aided refreshes and rolls (True) or everything on the server from
        client-rolled inputs (False; needs a ring deep enough for the whole layer).
    """

    name: ClassVar[str] = "crypto-ckks"
    kind: ClassVar[DefenseKind] = DefenseKind.TRANSFORMER
    poly_modulus_degree: int = INTERACTIVE.poly_modulus_degree
    coeff_mod_bit_sizes: tuple[int, ...] = INTERACTIVE.coeff_mod_bit_sizes
    scale_bits: int = INTERACTIVE.scale_bits
    interactive: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "coeff_mod_bit_sizes", tuple(self.coeff_mod_bit_sizes))
        self.params  # noqa: B018 - validates the parameters

    @property
    def params(self) -> CKKSParams:
        """The validated CKKS parameters."""
        return CKKSParams(
            self.poly_modulus_degree, self.coeff_mod_bit_sizes, self.scale_bits
        )

    def wrap(self, learner: Any) -> EncryptedLearner:
        """Return a learner whose system serves under CKKS."""
        return EncryptedLearner(learner, self.params, self.interactive)

    def certify(self, system: EncryptedDeployment, task: Any) -> dict[str, float]:
        """Security level and the measured correctness of encrypted inference."""
        p = self.params
        return {
            "security_bits": float(p.security_bits),
            "log_q": float(p.log_q),
            "log_q_bound": float(HE_STANDARD_128[p.poly_modulus_degree]),
            "poly_modulus_degree": float(p.poly_modulus_degree),
            "levels": float(p.levels),
            **system.stats,
        }


@dataclass(frozen=True)
class EmbeddingNoise:
    """Baseline: the client adds Gaussian noise to the embeddings it sends.

    Parameters
    ----------
    sigma : float
        Noise standard deviation, > 0.
    """

    name: ClassVar[str] = "crypto-noise"
    kind: ClassVar[DefenseKind] = DefenseKind.PREPROCESSOR
    sigma: float = 0.5

    def __post_init__(self) -> None:
        check_real("EmbeddingNoise.sigma", self.sigma, 0.0, open_low=True)

    def wrap(self, learner: Any) -> NoisyLearner:
        """Return a learner whose client perturbs its uploads."""
        return NoisyLearner(learner, float(self.sigma))
