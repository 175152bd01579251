"""Audit a fitted model: the suite's attacks on the user's model and data.

Given a fitted classifier (a scikit-learn estimator, a torch module or a callable
returning probabilities), the records it was trained on and records it was not,
:func:`audit` runs every membership-inference and model-inversion attack the threat
model allows, through the suite's :class:`~defenses.oracle.QueryOracle`, against the
model as it is and behind each defense to compare, on the same seeds, and returns an
:class:`AuditReport` (Markdown, JSON, plots). ``defense-suite audit SPEC.toml`` runs
the same from a spec (:mod:`defenses.audit.cli`).
"""

from defenses.audit.config import AuditConfig
from defenses.audit.report import AuditReport, Refusal
from defenses.audit.run import audit
from defenses.audit.shadows import ShadowConfig
from defenses.audit.threats import threat_model

__all__ = [
    "AuditConfig",
    "AuditReport",
    "Refusal",
    "ShadowConfig",
    "audit",
    "threat_model",
]
