"""The adversaries: a canary observer of client updates, and membership inference.

* :class:`CanaryObserver` - the curious server of :mod:`federated.audit`: it sees
  the audited client's released steps projected on the canary direction and scores
  each trial by the likelihood ratio at the claimed rates and by a matched filter.
* :class:`GlobalModelMIA` - loss-threshold membership inference on the final
  global model (Yeom et al., 2018), scored on the logit of the true-class
  probability (Carlini et al., 2022); the scenario reports it per privacy group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from defenses.arrays import FloatArray
from defenses.reference.attacks import LossThresholdAttack
from defenses.threat import Capability

from .audit import likelihood_ratio, matched_filter


@dataclass(frozen=True)
class AuditView:
    """What the observer sees of the audited client.

    The projected releases, the claimed rates and sigmas, and the canary inclusion
    profile of the client's (public) sampling code.
    """

    observations: FloatArray
    rates: tuple[float, ...]
    sigmas: tuple[float | None, ...]
    profile: FloatArray


@dataclass(frozen=True)
class CanaryObserver:
    """Score canary trials by likelihood ratio and matched filter (2 x trials)."""

    name: ClassVar[str] = "federated-canary-audit"
    requires: ClassVar[frozenset[Capability]] = frozenset({Capability.OBSERVE_TRAFFIC})

    def run(self, view: AuditView, rng: np.random.Generator) -> FloatArray:
        """Return one row of scores per statistic."""
        return np.stack(
            [
                likelihood_ratio(view.observations, view.rates, view.sigmas),
                matched_filter(view.observations, view.profile, view.sigmas),
            ]
        )


@dataclass(frozen=True)
class GlobalModelMIA(LossThresholdAttack):
    """Loss-threshold membership inference on the global model.

    The reference pair's :class:`~defenses.reference.attacks.LossThresholdAttack`
    under the federated name, with a floor suited to the softmax models here.

    Parameters
    ----------
    floor : float
        Probabilities are clipped to [floor, 1 - floor], in (0, 0.5).
    """

    name: ClassVar[str] = "federated-loss-mia"
    floor: float = 1e-12
