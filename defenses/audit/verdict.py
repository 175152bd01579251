r"""What an audit's numbers say, in words: glossary, verdict, flags, summary.

A report opens with a glossary of its columns and a one-paragraph verdict: the
strongest attack against the model as it is, what each defense does to it and at
what utility cost. Strength is measured by the **distance from chance** of the
headline success (:data:`HEADLINE`), never by its raw value: an AUC of 0.3 tells
members apart as well as 0.7 (flip the score), so

.. math::

    d = |\mathrm{AUC} - 0.5| \quad\text{(membership)}, \qquad
    d = \mathrm{acc@1} - 1/K \quad\text{(inversion: the judge's accuracy above
    guessing among K classes)} .

An arm is flagged ``STRONGER`` (or ``WEAKER``) against the undefended model when
the paired differences :math:`\Delta_s = d_{\text{defended}, s} -
d_{\text{undefended}, s}` over the seeds (same candidates, same attack randomness)
have a two-sided 95% Student-t interval
(:func:`defenses.results.t_interval`) that excludes zero *and* a mean beyond
:data:`RISE_TOLERANCE` in that direction. One seed gives no interval, so it never
flags (:func:`shifts`).

A cell is printed as ``mean ± std`` over seeds, and as ``mean`` alone when the
standard deviation is 0 (one seed, or a deterministic attack), so no cell reads
"± 0.000".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from defenses.results import (
    UNDEFENDED,
    Interval,
    Result,
    Summary,
    summarize,
    t_interval,
)

if TYPE_CHECKING:
    from defenses.audit.findings import Findings

HEADLINE = {"membership": "success.auc", "inversion": "success.acc@1"}
"""The success metric a verdict and a flag read, per kind of attack."""

NOUNS = {"success.auc": "AUC", "success.acc@1": "acc@1"}

RISE_TOLERANCE = 0.01
"""Smallest paired mean change of the distance from chance that is flagged."""

LEVEL = 0.95
"""Confidence level of the paired interval behind a flag."""

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
        "distance from chance",
        "how far the headline success is from guessing: |AUC - 0.5| for membership "
        "(an AUC below 0.5 is as strong as its mirror image above), acc@1 - 1/K "
        "for inversion",
    ),
    (
        "STRONGER / WEAKER",
        f"the arm moves the distance from chance up / down against the undefended "
        f"model: the paired {LEVEL:.0%} interval over seeds excludes 0 and the mean "
        f"change exceeds {RISE_TOLERANCE:g} (one seed never flags)",
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


def chance(kind: str, n_classes: int) -> float:
    """The headline success of guessing: AUC 0.5, or acc@1 of 1/K."""
    return 0.5 if kind == "membership" else 1.0 / n_classes


def distance(kind: str, value: float, n_classes: int) -> float:
    """Distance from chance of a headline success (see the module)."""
    if kind == "membership":
        return abs(value - 0.5)
    return value - chance(kind, n_classes)


@dataclass(frozen=True)
class Shift:
    """An arm that moves an attack's distance from chance (paired, over seeds)."""

    kind: str
    attack: str
    defense: str
    metric: str
    undefended: float
    defended: float
    change: Interval

    @property
    def stronger(self) -> bool:
        """True for STRONGER, False for WEAKER."""
        return self.change.mean > 0

    @property
    def delta(self) -> Summary:
        """Mean change of the distance and its count (the interval's)."""
        return Summary(self.change.mean, 0.0, self.change.n)

    def __str__(self) -> str:
        noun = NOUNS.get(self.metric, self.metric)
        word = "stronger" if self.stronger else "weaker"
        return (
            f"{self.defense} makes {self.attack} {word}: {noun} "
            f"{self.undefended:.3f} -> {self.defended:.3f} (distance from chance "
            f"{self.change.mean:+.3f}, paired {self.change.level:.0%} interval "
            f"[{self.change.low:+.3f}, {self.change.high:+.3f}] over "
            f"{self.change.n} seeds)"
        )


Rise = Shift
"""The former name of :class:`Shift` (a STRONGER flag)."""


def _means(runs: Sequence[Result], metric: str) -> dict[tuple[str, str], float]:
    out = {}
    for first, cells in summarize(runs, [metric]):
        summary = cells[metric]
        if summary is not None:
            out[(first.attack, first.defense)] = summary.mean
    return out


def _n_classes(report: Findings) -> int:
    return int(report.data.get("n_classes", 2))


def _paired_changes(report: Findings, kind: str) -> dict[tuple[str, str], list[float]]:
    """Per (attack, defended arm): the seeds' changes of the distance from chance."""
    metric = HEADLINE[kind]
    key = metric.partition(".")[2]
    runs = [r for r in report.of_kind(kind) if key in r.success]
    k = _n_classes(report)
    plain = {
        (r.attack, r.seed): distance(kind, r.get(metric), k)
        for r in runs
        if r.defense == UNDEFENDED
    }
    changes: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        if r.defense == UNDEFENDED or (r.attack, r.seed) not in plain:
            continue
        d = distance(kind, r.get(metric), k) - plain[(r.attack, r.seed)]
        changes.setdefault((r.attack, r.defense), []).append(d)
    return changes


def shifts(report: Findings) -> list[Shift]:
    """Every (attack, arm) flagged STRONGER or WEAKER (see the module)."""
    found = []
    for kind, metric in HEADLINE.items():
        means = _means(report.of_kind(kind), metric)
        for (attack, defense), values in _paired_changes(report, kind).items():
            if len(values) < 2:
                continue
            change = t_interval(values, LEVEL)
            if not change.excludes_zero or abs(change.mean) <= RISE_TOLERANCE:
                continue
            found.append(
                Shift(
                    kind,
                    attack,
                    defense,
                    metric,
                    means[(attack, UNDEFENDED)],
                    means[(attack, defense)],
                    change,
                )
            )
    return found


def rises(report: Findings) -> list[Shift]:
    """The arms flagged STRONGER (:func:`shifts`)."""
    return [s for s in shifts(report) if s.stronger]


def falls(report: Findings) -> list[Shift]:
    """The arms flagged WEAKER (:func:`shifts`)."""
    return [s for s in shifts(report) if not s.stronger]


def _kind_verdict(report: Findings, kind: str, title: str) -> str | None:
    metric = HEADLINE[kind]
    runs = report.of_kind(kind)
    means = _means(runs, metric)
    accuracy = _means(runs, "utility.accuracy")
    k = _n_classes(report)
    plain = {a: v for (a, d), v in means.items() if d == UNDEFENDED}
    if not plain:
        return None
    attack = max(plain, key=lambda a: distance(kind, plain[a], k))
    noun = NOUNS[metric]
    text = (
        f"{title}: against the model as it is, the strongest attack is `{attack}` "
        f"({noun} {plain[attack]:.3f}, chance {chance(kind, k):.3g})"
    )
    weaker = {s.defense: s for s in falls(report) if s.attack == attack}
    if weaker:
        best = min(weaker, key=lambda d: weaker[d].change.mean)
        before, after = accuracy[(attack, UNDEFENDED)], accuracy[(attack, best)]
        text += (
            f"; the most protective arm, `{best}`, brings it to "
            f"{means[(attack, best)]:.3f} (distance from chance "
            f"{weaker[best].change.mean:+.3f}, paired interval excluding 0; test "
            f"accuracy {before:.3f} -> {after:.3f})"
        )
    elif any(d != UNDEFENDED for (a, d) in means if a == attack):
        seeds = len(report.settings.get("seeds", []))
        text += (
            "; no arm moves it measurably towards chance (a paired "
            f"{LEVEL:.0%} interval excluding 0 and a change beyond "
            f"{RISE_TOLERANCE:g}"
            + ("; one seed gives no interval" if seeds < 2 else "")
            + ")"
        )
    return text


def verdict(report: Findings) -> str:
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
            f"Read the numbers with care: {len(report.warnings)} warning(s) about the "
            "inputs or the model's answers below"
        )
    return ". ".join(sentences) + "."


def glossary_lines() -> list[str]:
    """The glossary as Markdown list lines."""
    return [f"- **{term}**: {meaning}." for term, meaning in GLOSSARY]


def summary_lines(report: Findings, written: Mapping[str, object]) -> list[str]:
    """The command's summary: headline numbers per attack and arm, flags, files."""
    lines = [f"audit {report.name!r}: seeds {report.settings['seeds']}"]
    for kind, metric in HEADLINE.items():
        means = _means(report.of_kind(kind), metric)
        for attack in dict.fromkeys(a for a, _ in means):
            arms = [f"{d} {v:.3f}" for (a, d), v in means.items() if a == attack]
            noun = NOUNS[metric]
            lines.append(f"  {kind} {attack} ({noun}): " + ", ".join(arms))
    for shift in shifts(report):
        lines.append(f"  {'STRONGER' if shift.stronger else 'WEAKER'}: {shift}")
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
