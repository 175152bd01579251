"""What an audit measured, as data: the runs, the ROC curves, refusals, warnings.

The bottom of the audit's reporting layers: :mod:`defenses.audit.verdict` reads a
:class:`Findings` into words and flags, :mod:`defenses.audit.plots` draws it, and
:class:`defenses.audit.report.AuditReport` (a :class:`Findings` that renders itself
as Markdown, JSON and plots) imports both. Nothing here imports them back, so the
layers form no circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from defenses.arrays import FloatArray
from defenses.results import Result
from defenses.threat import ThreatModel


@dataclass(frozen=True, eq=False)
class Refusal:
    """An attack the audit did not run, and why (a threat-model or budget refusal)."""

    attack: str
    reason: str


@dataclass(frozen=True, eq=False)
class Curve:
    """The ROC curve of one membership run."""

    attack: str
    defense: str
    seed: int
    fpr: FloatArray
    tpr: FloatArray


@dataclass(frozen=True, eq=False)
class Findings:
    """What an audit measured.

    Attributes
    ----------
    name : str
        The audit's name.
    threat : ThreatModel
        The threat model the audit enforced.
    results : tuple of Result
        One record per (attack, arm, seed); ``meta["kind"]`` is "membership" or
        "inversion".
    curves : tuple of Curve
        ROC curves of the membership runs.
    refusals : tuple of Refusal
        Attacks not run, with the reason.
    data : Mapping
        Sizes of the record sets, classes, input shape, the arms.
    settings : Mapping
        Seeds, the epsilon bound's delta and confidence, shadows, reconstructions.
    warnings : tuple of str
        Why the inputs or the model's answers may make the numbers unreliable
        (:func:`~defenses.audit.preflight.degenerate_inputs`,
        :func:`~defenses.audit.preflight.degenerate_answers`).
    """

    name: str
    threat: ThreatModel
    results: tuple[Result, ...]
    curves: tuple[Curve, ...]
    refusals: tuple[Refusal, ...]
    data: Mapping[str, Any]
    settings: Mapping[str, Any]
    warnings: tuple[str, ...] = ()

    def of_kind(self, kind: str) -> list[Result]:
        """The results of one kind of attack ("membership" or "inversion")."""
        return [r for r in self.results if r.meta.get("kind") == kind]

    def result(self, attack: str, defense: str, seed: int) -> Result:
        """The run of ``attack`` against the arm ``defense`` at ``seed``."""
        for r in self.results:
            if r.attack == attack and r.defense == defense and r.seed == seed:
                return r
        raise KeyError(f"no run of {attack!r} against {defense!r} at seed {seed}")

    @property
    def refused(self) -> dict[str, str]:
        """Refused attack name -> reason."""
        return {r.attack: r.reason for r in self.refusals}
