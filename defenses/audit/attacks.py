r"""Membership attacks the audit adds to the reference pair's loss and label-only ones.

* :class:`ConfidenceThresholdAttack` (Salem et al., NDSS 2019, "ML-Leaks"): the score
  is the top probability :math:`\max_k p_k(x)`; it needs no label.
* :class:`OfflineLiRA` (Carlini et al., IEEE S&P 2022, "Membership inference attacks
  from first principles", the offline variant): shadow models are trained on random
  halves of the candidates; for candidate :math:`i` the shadows that did *not* see it
  give the logit-scaled confidences :math:`\phi_k(x_i) = \log\frac{p_y}{1-p_y}`, and
  the target's confidence is compared with them,

  .. math::

      s_i = \frac{\phi_{\text{target}}(x_i) - \mu_{\text{out},i}}{\sigma_{\text{out}}},

  with :math:`\mu_{\text{out},i}` the mean over the out-shadows and
  :math:`\sigma_{\text{out}}` the global standard deviation of the out-residuals (the
  paper's fixed-variance variant, advised for few shadows). :math:`s_i` ranks as the
  paper's one-sided likelihood test :math:`\Phi(s_i)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from defenses.arrays import BoolArray, FloatArray
from defenses.reference.attacks import LossThresholdAttack, MembershipView
from defenses.threat import Capability

SIGMA_FLOOR = 1e-6
"""Smallest out-residual standard deviation (identical shadows give zero)."""


@dataclass(frozen=True, eq=False)
class ShadowScores:
    """What the shadows say about each candidate.

    Attributes
    ----------
    trained_on : ndarray of shape (S, n), bool
        Whether shadow k was trained on candidate i.
    phi : ndarray of shape (S, n)
        Logit-scaled confidence of shadow k in candidate i's label.
    """

    trained_on: BoolArray
    phi: FloatArray


@dataclass(frozen=True)
class ShadowView(MembershipView):
    """A membership view plus the adversary's shadow models (needs auxiliary data).

    ``shadows(rng)`` trains (or returns the already trained) shadows for the
    candidates, drawing their data split and seeds from ``rng``.
    """

    shadows: Callable[[np.random.Generator], ShadowScores] | None = None


@dataclass(frozen=True)
class ConfidenceThresholdAttack:
    """Score each candidate by the target's top probability."""

    name: ClassVar[str] = "confidence-mia"
    requires: ClassVar[frozenset[Capability]] = frozenset({Capability.QUERY_SCORES})

    def run(self, view: MembershipView, rng: np.random.Generator) -> FloatArray:
        """Membership scores in [0, 1] (higher means more likely a member)."""
        scores = np.asarray(view.oracle(view.candidates), dtype=np.float64)
        if scores.ndim != 2:
            raise ValueError("the confidence attack needs score vectors, got labels")
        out: FloatArray = scores.max(axis=1)
        return out


def lira_scores(target_phi: FloatArray, bank: ShadowScores) -> FloatArray:
    """Offline LiRA statistic of every candidate (see the module docstring)."""
    out = ~bank.trained_on
    if not np.all(out.any(axis=0)):
        raise ValueError("every candidate needs at least one shadow that left it out")
    mu = (bank.phi * out).sum(axis=0) / out.sum(axis=0)
    residuals = (bank.phi - mu)[out]
    sigma = max(float(np.std(residuals)), SIGMA_FLOOR)
    result: FloatArray = (target_phi - mu) / sigma
    return result


@dataclass(frozen=True)
class OfflineLiRA(LossThresholdAttack):
    """Offline likelihood-ratio attack with shadow models.

    The loss attack's statistic (the true-class logit of
    :class:`~defenses.reference.attacks.LossThresholdAttack`, with its ``floor``),
    standardized by the shadows that left each candidate out (:func:`lira_scores`).
    """

    name: ClassVar[str] = "lira-offline"
    requires: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.QUERY_SCORES, Capability.AUX_DATA}
    )

    def run(self, view: MembershipView, rng: np.random.Generator) -> FloatArray:
        """Membership scores (higher means more likely a member)."""
        if not isinstance(view, ShadowView) or view.shadows is None:
            raise ValueError("OfflineLiRA needs a ShadowView with shadow models")
        bank = view.shadows(rng)
        target = super().run(view, rng)
        return lira_scores(target, bank)
