"""The audit's report: tables as in ``results/REPORT.md``, JSON, and the plot files.

A one-paragraph verdict and a glossary of the columns open the report
(:mod:`defenses.audit.verdict`); then the input warnings, if any; the threat model,
in words and as data; the records audited (and where the validation records came
from); then, per kind of attack, the mean ± standard deviation over seeds of every
arm (the mean alone where there is no spread) and the paired deltas (defended minus
undefended at the same seed), with the utility cost (test accuracy, L1 distortion of
the answers) beside the attack numbers and every arm that moves an attack's distance
from chance flagged ``STRONGER`` or ``WEAKER`` (:func:`~defenses.audit.verdict.shifts`:
a paired interval excluding zero); then the attacks the threat model refused, each
with its reason.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from defenses.audit.findings import Curve, Findings, Refusal
from defenses.audit.threats import describe
from defenses.audit.verdict import Shift, cell, glossary_lines, shifts, verdict
from defenses.results import Result, Summary, paired_deltas, summarize, write_jsonl

__all__ = ["AuditReport", "Curve", "Refusal"]

UTILITY = ["utility.accuracy", "utility.l1_distortion"]
MEMBERSHIP_COLUMNS = [
    *UTILITY,
    "success.auc",
    "success.tpr@0.1%fpr",
    "success.tpr@1%fpr",
    "success.advantage",
    "success.eps_lb",
    "cost.queries",
]
INVERSION_SUCCESS = ["success.acc@1", "success.acc@2", "success.acc@5"]
INVERSION_COLUMNS = [
    *UTILITY,
    *INVERSION_SUCCESS,
    "success.verified_rate",
    "success.feature_dist",
    "cost.queries",
]


def _table(
    rows: Sequence[tuple[Result, Mapping[str, Summary | None]]],
    columns: Sequence[str],
    seeds: bool,
    flagged: Mapping[tuple[str, str], str] | None = None,
) -> list[str]:
    shown = [c for c in columns if any(cells.get(c) is not None for _, cells in rows)]
    head = ["attack", "defense", *(["seeds"] if seeds else []), *shown]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for first, cells in rows:
        n = next((s.n for s in cells.values() if s is not None), 0)
        arm = first.defense
        flag = (flagged or {}).get((first.attack, arm))
        if flag:
            arm += f" **{flag}**"
        cols = [first.attack, arm, *([str(n)] if seeds else [])]
        lines.append(
            "| " + " | ".join([*cols, *(cell(cells[c], c) for c in shown)]) + " |"
        )
    return lines


def _shift_dict(shift: Shift) -> dict[str, Any]:
    return {
        "kind": shift.kind,
        "attack": shift.attack,
        "defense": shift.defense,
        "metric": shift.metric,
        "undefended": shift.undefended,
        "defended": shift.defended,
        "distance_change_mean": shift.change.mean,
        "distance_change_low": shift.change.low,
        "distance_change_high": shift.change.high,
        "level": shift.change.level,
        "seeds": shift.change.n,
    }


@dataclass(frozen=True, eq=False)
class AuditReport(Findings):
    """What an audit measured, and its Markdown, JSON and plot files.

    The data and their accessors are :class:`~defenses.audit.findings.Findings`'.
    """

    def to_dict(self) -> dict[str, Any]:
        """The whole report as JSON-ready data (infinite values become None)."""

        def finite(value: float) -> float | None:
            return value if math.isfinite(value) else None

        return {
            "name": self.name,
            "threat": self.threat.to_dict(),
            "threat_summary": describe(self.threat),
            "data": dict(self.data),
            "settings": dict(self.settings),
            "verdict": verdict(self),
            "warnings": list(self.warnings),
            "stronger": [_shift_dict(r) for r in shifts(self) if r.stronger],
            "weaker": [_shift_dict(r) for r in shifts(self) if not r.stronger],
            "refusals": [
                {"attack": r.attack, "reason": r.reason} for r in self.refusals
            ],
            "results": [
                {
                    **r.to_dict(),
                    "success": {k: finite(v) for k, v in r.success.items()},
                    "cost": {k: finite(v) for k, v in r.cost.items()},
                }
                for r in self.results
            ],
            "roc": [
                {
                    "attack": c.attack,
                    "defense": c.defense,
                    "seed": c.seed,
                    "fpr": c.fpr.tolist(),
                    "tpr": c.tpr.tolist(),
                }
                for c in self.curves
            ],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(
            self.to_dict(), indent=indent, sort_keys=False, allow_nan=False
        )

    def _section(self, title: str, kind: str, columns: list[str]) -> list[str]:
        runs = self.of_kind(kind)
        if not runs:
            return []
        flagged = {
            (r.attack, r.defense): "STRONGER" if r.stronger else "WEAKER"
            for r in shifts(self)
        }
        lines = [
            f"## {title}",
            "",
            "Mean ± standard deviation over seeds (a value alone: no spread):",
            "",
        ]
        lines += _table(summarize(runs, columns), columns, True, flagged)
        deltas = paired_deltas(runs, columns[:-1])
        if deltas:
            lines += [
                "",
                "Paired deltas (defended minus undefended, same seed), mean ± std:",
                "",
                *_table(deltas, columns[:-1], True, flagged),
            ]
        return [*lines, ""]

    def to_markdown(self, plots: Mapping[str, str] | None = None) -> str:
        """The report as Markdown; ``plots`` maps captions to image paths to embed."""
        d = self.data
        threat = self.threat.to_dict()
        lines = [
            f"# Privacy audit: {self.name}",
            "",
            f"**Verdict.** {verdict(self)}",
            "",
            "## Glossary",
            "",
            *glossary_lines(),
            "",
        ]
        if self.warnings:
            lines += ["## Input warnings", ""]
            lines += [f"- {reason}" for reason in self.warnings]
            lines.append("")
        lines += [
            f"**Threat model.** {describe(self.threat)}",
            "",
            f"Capabilities: {', '.join(threat['capabilities'])}; "
            f"query budget per attack: {threat['budget']['queries'] or 'unlimited'}; "
            f"adaptive: {'yes' if threat['adaptive'] else 'no'}.",
            "",
            f"**Records.** {d['members']} members, {d['non_members']} non-members, "
            f"{d['test']} test records (utility), {d['validation']} validation records "
            f"(defense fitting, {d.get('validation_source', 'given')}); "
            f"{d['n_classes']} classes, input shape "
            f"{tuple(d['input_shape'])}."
            + (
                f" Private classes {', '.join(d['private_classes'])} "
                f"({d['public']} public records for the inversion adversary)."
                if d.get("private_classes")
                else ""
            ),
            "",
            f"Seeds {self.settings['seeds']}; every arm of a seed shares the attack's "
            "randomness (paired). eps_lb: the largest epsilon lower bound over the ROC "
            f"thresholds at one-sided {self.settings['confidence']:.0%} confidence "
            f"(Clopper-Pearson), delta = {self.settings['delta']:g}; "
            "the confidence interval is [eps_lb, inf).",
            "",
        ]
        lines += self._section("Membership inference", "membership", MEMBERSHIP_COLUMNS)
        lines += self._section(
            "Model inversion of the private classes", "inversion", INVERSION_COLUMNS
        )
        if self.refusals:
            lines += ["## Refused by the threat model or the budget", ""]
            lines += [f"- `{r.attack}`: {r.reason}" for r in self.refusals]
            lines.append("")
        for caption, path in (plots or {}).items():
            lines += [f"![{caption}]({path})", ""]
        return "\n".join(lines)

    def write(self, out: str | Path) -> dict[str, Path]:
        """Write ``report.md``, ``report.json``, ``results.jsonl`` and the plots."""
        from defenses.audit.plots import roc_plot, tradeoff_plot

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        plots: dict[str, str] = {}
        written: dict[str, Path] = {}
        if self.curves:
            written["roc"] = roc_plot(self, folder / "roc.png")
            plots["ROC of the membership attacks (log-log)"] = "roc.png"
        tradeoff = tradeoff_plot(self, folder / "tradeoff.png")
        if tradeoff is not None:
            written["tradeoff"] = tradeoff
            plots["utility against attack success"] = "tradeoff.png"
        written["markdown"] = folder / "report.md"
        written["markdown"].write_text(self.to_markdown(plots), encoding="utf-8")
        written["json"] = folder / "report.json"
        written["json"].write_text(self.to_json(), encoding="utf-8")
        written["results"] = folder / "results.jsonl"
        written["results"].unlink(missing_ok=True)
        write_jsonl(self.results, written["results"])
        return written
