"""RPS: reliable conformal prediction sets under data poisoning.

Scholten & Günnemann, "Provably Reliable Conformal Prediction Sets in the Presence of
Data Poisoning", ICLR 2025. Training data is split by a hash of the input into
``k_t`` parts with one classifier each; the score is the softmax of the vote
fractions. Calibration data is split into ``k_c`` parts, each giving a split-conformal
set; a class is kept when more than ``tau_hat(alpha)`` of the part sets hold it,
``alpha = 1 - confidence_level``. Counting arguments certify, per test point and
class, how many poisoned training and calibration points the set withstands.

:class:`ReliableConformalClassifier` is a scikit-learn meta-estimator in MAPIE 1.x's
vocabulary (``fit``, ``conformalize``, ``predict_set``, ``confidence_level``) plus
``certify``. :func:`suggest_parts` proposes a partition for the data size and the
radius wanted; ``conformalize`` warns (:class:`EmptyCertificateWarning`) when the
partition certifies nothing.
"""

from defenses.rps.advice import EmptyCertificateWarning, PartPlan, suggest_parts
from defenses.rps.certificate import Certificate
from defenses.rps.defense import NotConformalizedError, ReliableConformalClassifier
from defenses.rps.ensemble import PartTrainingError, PartVoter, TorchPartClassifier
from defenses.rps.parts import DegeneratePartsWarning

__all__ = [
    "Certificate",
    "DegeneratePartsWarning",
    "EmptyCertificateWarning",
    "NotConformalizedError",
    "PartPlan",
    "PartTrainingError",
    "PartVoter",
    "ReliableConformalClassifier",
    "TorchPartClassifier",
    "suggest_parts",
]
