r"""What an audit's numbers say, in words: glossary, verdict, flags, summary.

A report opens with a glossary of its columns and a one-paragraph verdict: the
strongest attack against the model as it is, what each defense does to it and at
what utility cost. An arm whose attack success *rises* against the undefended model
is flagged (:func:`rises`): its paired mean delta of the headline success
(:data:`HEADLINE`: membership AUC, inversion acc@1) exceeds :data:`RISE_TOLERANCE`,

.. math::

    \bar\Delta = \frac1S \sum_{s} \big(m_{\text{defended}, s} -
    m_{\text{undefended}, s}\big) > \tau .

A cell is printed as ``mean ± std`` over seeds, and as ``mean`` alone when the
standard deviation is 0 (one seed, or a deterministic attack), so no cell reads
"± 0.000".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from defenses.results import UNDEFENDED, Result, Summary, paired_deltas, summarize

if TYPE_CHECKING:
    from defenses.audit.report import AuditReport

HEADLINE = {"membership": "success.auc", "inversion": "success.acc@1"}
"""The success metric a verdict and a flag read, per kind of attack."""

NOUNS = {"success.auc": "AUC", "success.acc@1": "acc@1"}

RISE_TOLERANCE = 0.01
"""Smallest paired mean rise of the headline success that is flagged."""

GLOSSARY = [
    ("members / non-members", "records the model was / was not trained on"),
    (
        "AUC",
        "area under the ROC of the attack's member scores (0.5: chance, 1: every "
        "record told apart); ties count half",
    ),
    ("tpr@1%fpr", "share of members found when 1% of non-members are accused"),
    ("advantage", "max over thresholds of TPR - FPR (0: chance)"),
    (
        "eps_lb",
        "a lower bound on the differential-privacy epsilon the model can have "
        "(0: no evidence of leakage)",
    ),
    (
        "acc@1 / acc@k",
        "share of reconstructions an independent classifier assigns to the private "
        "class (in its top k)",
    ),
    (
        "verified_rate",
        "share of reconstructions whose nearest record is a private one of the class",
    ),
    (
        "feature_dist",
        "distance of a reconstruction to the private records (lower: "
        "closer, a stronger attack)",
    ),
    ("accuracy", "test accuracy of the answers (utility)"),
    ("l1_distortion", "mean L1 distance of the answers to the undefended ones"),
    (
        "paired delta",
        "defended minus undefended at the same seed (same candidates, same attack "
        "randomness); for every success column but feature_dist, > 0 means the "
        "attack got stronger",
    ),
    ("a ± b", "mean ± standard deviation over seeds; a value alone has no spread"),
    (
        "STRONGER",
        f"the arm raises the headline success (AUC or acc@1) by more than "
        f"{RISE_TOLERANCE:g} against the undefended model",
    ),
]


def cell(summary: Summary | None, column: str = "") -> str:
    """A table cell: ``mean ± std``, or ``mean`` when there is no spread."""
    if summary is None:
        return "–"
    digits = 0 if column.startswith("cost.") else 3
    mean = f"{summary.mean:.{digits}f}"
    if summary.n < 2 or summary.std == 0:
        return mean
    return f"{mean} ± {summary.std:.{digits}f}"


@dataclass(frozen=True)
class Rise:
    """An arm that makes an attack stronger (paired, over seeds)."""

    kind: str
    attack: str
    defense: str
    metric: str
    undefended: float
    defended: float
    delta: Summary

    def __str__(self) -> str:
        noun = NOUNS.get(self.metric, self.metric)
        return (
            f"{self.defense} makes {self.attack} stronger: {noun} "
            f"{self.undefended:.3f} -> {self.defended:.3f} "
            f"(paired delta {cell(self.delta)} over {self.delta.n} seeds)"
        )


def _means(runs: Sequence[Result], metric: str) -> dict[tuple[str, str], float]:
    out = {}
    for first, cells in summarize(runs, [metric]):
        summary = cells[metric]
        if summary is not None:
            out[(first.attack, first.defense)] = summary.mean
    return out


def rises(report: AuditReport) -> list[Rise]:
    """Every (attack, arm) whose headline success rises (see the module)."""
    found = []
    for kind, metric in HEADLINE.items():
        runs = report.of_kind(kind)
        means = _means(runs, metric)
        for first, cells in paired_deltas(runs, [metric]):
            delta = cells[metric]
            if delta is None or delta.mean <= RISE_TOLERANCE:
                continue
            found.append(
                Rise(
                    kind,
                    first.attack,
                    first.defense,
                    metric,
                    means[(first.attack, UNDEFENDED)],
                    means[(first.attack, first.defense)],
                    delta,
                )
            )
    return found


def _kind_verdict(report: AuditReport, kind: str, title: str) -> str | None:
    metric = HEADLINE[kind]
    runs = report.of_kind(kind)
    means = _means(runs, metric)
    accuracy = _means(runs, "utility.accuracy")
    plain = {a: v for (a, d), v in means.items() if d == UNDEFENDED}
    if not plain:
        return None
    attack = max(plain, key=lambda a: plain[a])
    noun = NOUNS[metric]
    text = (
        f"{title}: against the model as it is, the strongest attack is `{attack}` "
        f"({noun} {plain[attack]:.3f}"
        + (", chance 0.5)" if kind == "membership" else ")")
    )
    arms = {d: v for (a, d), v in means.items() if a == attack and d != UNDEFENDED}
    if arms:
        best = min(arms, key=lambda d: arms[d])
        before, after = accuracy[(attack, UNDEFENDED)], accuracy[(attack, best)]
        if arms[best] < plain[attack] - RISE_TOLERANCE:
            text += (
                f"; the most protective arm, `{best}`, brings it to {arms[best]:.3f} "
                f"(test accuracy {before:.3f} -> {after:.3f})"
            )
        else:
            text += "; no arm lowers it by more than " + f"{RISE_TOLERANCE:g}"
    return text


def verdict(report: AuditReport) -> str:
    """The report's opening paragraph, in plain words."""
    sentences = [
        s
        for s in (
            _kind_verdict(report, "membership", "Membership inference"),
            _kind_verdict(report, "inversion", "Model inversion"),
        )
        if s
    ]
    if not sentences:
        sentences = ["No attack ran (see the refusals below)"]
    flagged = rises(report)
    if flagged:
        sentences.append(
            "Some arms make an attack stronger than against the undefended model: "
            + "; ".join(str(r) for r in flagged)
        )
    if report.warnings:
        sentences.append(
            f"Read the numbers with care: {len(report.warnings)} input warning(s) below"
        )
    return ". ".join(sentences) + "."


def glossary_lines() -> list[str]:
    """The glossary as Markdown list lines."""
    return [f"- **{term}**: {meaning}." for term, meaning in GLOSSARY]


def summary_lines(report: AuditReport, written: Mapping[str, object]) -> list[str]:
    """The command's summary: headline numbers per attack and arm, flags, files."""
    lines = [f"audit {report.name!r}: seeds {report.settings['seeds']}"]
    for kind, metric in HEADLINE.items():
        means = _means(report.of_kind(kind), metric)
        for attack in dict.fromkeys(a for a, _ in means):
            arms = [f"{d} {v:.3f}" for (a, d), v in means.items() if a == attack]
            noun = NOUNS[metric]
            lines.append(f"  {kind} {attack} ({noun}): " + ", ".join(arms))
    for rise in rises(report):
        lines.append(f"  STRONGER: {rise}")
    for reason in report.warnings:
        lines.append(f"  warning: {reason}")
    if report.refusals:
        lines.append(
            "  refused: "
            + ", ".join(r.attack for r in report.refusals)
            + " (reasons in the report)"
        )
    if "markdown" in written:
        lines.append(f"report: {written['markdown']}")
    return lines
