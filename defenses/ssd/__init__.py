"""SSD: the Stealthy Shield Defense against black-box model inversion (ICLR 2025).

Zhuang et al., *Stealthy Shield Defense: A Conditional Mutual Information-Based
Approach against Black-Box Model Inversion Attacks*, ICLR 2025. A training-free
post-processor: :class:`~defenses.ssd.defense.StealthyShield` wraps a deployed model
(torch module, scikit-learn classifier or callable) and answers each query with the
KL projection of its output towards a randomly chosen class prototype, within an
entropy-scaled L1 budget (:func:`~defenses.ssd.waterfill.water_filling`).

Ways in for a user's own model: :mod:`defenses.ssd.sklearn` (a scikit-learn
meta-estimator), :mod:`defenses.ssd.torch` (a module whose ``state_dict`` carries
the defense) and :mod:`defenses.ssd.art` (an IBM ART post-processor; importing it
imports ART).
"""

from defenses.ssd.defense import StealthyShield, default_temperature, entropy
from defenses.ssd.solver import solve_reference
from defenses.ssd.waterfill import water_filling

__all__ = [
    "StealthyShield",
    "default_temperature",
    "entropy",
    "solve_reference",
    "water_filling",
]
