"""The report's summary table: each package's headline claim, our number, a verdict."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from defense_suite.magnitude import Magnitude, check
from defense_suite.spec import Spec, SummarySettings
from defense_suite.tables import show
from defenses.results import Interval, Result, Summary, describe, paired_interval

REPRODUCED = "reproduced"
PARTLY = "partly"
NOT_REPRODUCED = "not reproduced"
PROJECTED = "projected"
DIRECTION_ONLY = "direction reproduced, magnitude not"
"""The direction is reproduced (by at least ``relative_change``), but the change
falls short of the size the paper states (:mod:`defense_suite.magnitude`)."""


def magnitude_of(settings: SummarySettings) -> Magnitude | None:
    """The size the row's claim states, or None when it states none."""
    if not settings.has_magnitude:
        return None
    return Magnitude(
        settings.direction,
        settings.paper_baseline,
        settings.paper_defended,
        settings.paper_ratio,
    )


def with_magnitude(
    settings: SummarySettings,
    outcome: str,
    defended: float,
    undefended: float,
    interval: Interval | None = None,
) -> tuple[str, str]:
    """The verdict and its note once the claim's stated size is checked.

    *Reproduced* stays only where the measured change reaches the stated size;
    otherwise it becomes :data:`DIRECTION_ONLY`. Other verdicts stand; the note
    compares ours with the paper's either way (empty for a claim without a size).
    """
    magnitude = magnitude_of(settings)
    if magnitude is None:
        return outcome, ""
    met, note = check(magnitude, defended, undefended, interval)
    return (DIRECTION_ONLY if outcome == REPRODUCED and not met else outcome), note


@dataclass(frozen=True)
class SummaryRow:
    """One defense's line in the summary table."""

    spec: str
    title: str
    threat: str
    attack: str
    paper: str
    defended: Summary
    undefended: Summary
    delta: Summary
    peers: list[tuple[str, Summary]]
    guarantee: tuple[str, Summary] | None
    verdict: str
    utility_cost: tuple[str, Summary] | None = None
    note: str = ""
    interval: Interval | None = None


def _values(results: Sequence[Result], metric: str) -> list[float]:
    section, _, key = metric.partition(".")
    return [r.get(metric) for r in results if key in getattr(r, section, {})]


def _arm(results: Sequence[Result], attack: str, defense: str) -> list[Result]:
    """Runs of the first arm (in run order) whose labels start with the prefixes."""
    matching = [
        r
        for r in results
        if r.attack.startswith(attack) and r.defense.startswith(defense)
    ]
    if not matching:
        return []
    first = matching[0].arm
    return [r for r in matching if r.arm == first]


def _pair_key(result: Result) -> str:
    return json.dumps([result.seed, result.params.get("scenario", {})], sort_keys=True)


def _paired(
    defended: Sequence[Result], baseline: Sequence[Result], metric: str
) -> Summary | None:
    """Summary of defended minus baseline over runs with the same seed and setting."""
    base = {_pair_key(r): r for r in baseline}
    section, _, key = metric.partition(".")
    diffs = [
        r.get(metric) - base[_pair_key(r)].get(metric)
        for r in defended
        if _pair_key(r) in base
        and key in getattr(r, section)
        and key in getattr(base[_pair_key(r)], section)
    ]
    return describe(diffs) if diffs else None


def verdict(settings: SummarySettings, defended: float, undefended: float) -> str:
    """Compare the relative change with the claimed direction and size.

    The change is :math:`c = (d - u) / |u|` (defended mean :math:`d`, baseline
    mean :math:`u`), compared with ``relative_change`` in ``direction``. A row with
    ``basis = "projected"`` gets :data:`PROJECTED` whatever the comparison gives
    (:func:`projection_note` says what it gives).
    """
    if settings.basis == PROJECTED:
        return PROJECTED
    return _outcome(settings, defended, undefended)


def projection_note(
    settings: SummarySettings,
    defended: float,
    undefended: float,
    runs: Sequence[Result] = (),
) -> str:
    """For a projected row: what was measured and what the projection would give.

    With ``settings.interval``, the mean of its two metrics over the defended
    ``runs`` is stated as the projection's interval.
    """
    if settings.basis != PROJECTED:
        return ""
    outcome, sized = with_magnitude(
        settings, _outcome(settings, defended, undefended), defended, undefended
    )
    outcome += f" ({sized})" if sized else ""
    bounds = [_values(runs, metric) for metric in settings.interval]
    span = ""
    if settings.interval and all(bounds):
        low, high = (describe(values).mean for values in bounds)
        names = " .. ".join(m.partition(".")[2] for m in settings.interval)
        span = f"; interval {names} = {low:.3g} .. {high:.3g}"
    return f"measured {settings.measured_range}{span}; the projection alone: {outcome}"


def _outcome(settings: SummarySettings, defended: float, undefended: float) -> str:
    change = (defended - undefended) / max(abs(undefended), 1e-12)
    if settings.direction in ("same", "within"):
        moved = abs(change) if settings.direction == "same" else change
        if moved <= settings.relative_change:
            return REPRODUCED
        return PARTLY if moved <= 2 * settings.relative_change else NOT_REPRODUCED
    if settings.direction == "higher":
        change = -change
    if change <= -settings.relative_change and change < 0:
        return REPRODUCED
    if change < 0:
        return PARTLY
    return NOT_REPRODUCED


def interval_verdict(outcome: str, paired: tuple[Interval, str] | None) -> str:
    """Temper a measured verdict by the paired 95 % t-interval of the difference.

    ``paired`` is :func:`defenses.results.paired_interval`'s answer for the row's
    claimed direction. A claim whose interval lies on the wrong side of zero is
    :data:`NOT_REPRODUCED`; one whose interval holds zero is at most
    :data:`PARTLY` (the seeds cannot tell it from no effect). Without two paired
    runs the measured verdict stands.
    """
    if paired is None:
        return outcome
    side = paired[1]
    if side == "contradicted":
        return NOT_REPRODUCED
    if side == "inconclusive" and outcome == REPRODUCED:
        return PARTLY
    return outcome


def summary_row(spec: Spec, results: Sequence[Result]) -> SummaryRow | None:
    """The summary row of ``spec``, or None if it has none or its arms did not run."""
    settings = spec.report.summary
    if settings is None:
        return None
    defended = _arm(results, settings.attack, settings.defense)
    undefended = _arm(results, settings.attack, settings.baseline)
    d_values = _values(defended, settings.metric)
    u_values = _values(undefended, settings.metric)
    if not d_values or not u_values:
        return None
    delta = _paired(defended, undefended, settings.metric)
    d, u = describe(d_values), describe(u_values)
    peers = []
    for prefix in settings.peers:
        arm = _arm(results, settings.attack, prefix)
        values = _values(arm, settings.metric)
        if values:
            peers.append((arm[0].defense, describe(values)))
    guarantee = None
    if settings.guarantee:
        values = _values(defended, settings.guarantee)
        if values:
            guarantee = (settings.guarantee.partition(".")[2], describe(values))
    utility_cost = None
    if settings.utility:
        cost = _paired(defended, undefended, settings.utility)
        if cost is not None:
            utility_cost = (settings.utility.partition(".")[2], cost)
    outcome = verdict(settings, d.mean, u.mean)
    paired = None
    if settings.direction in ("higher", "lower") and outcome != PROJECTED:
        paired = paired_interval(
            defended, undefended, settings.metric, settings.direction
        )
        outcome = interval_verdict(outcome, paired)
    note = projection_note(settings, d.mean, u.mean, defended)
    if outcome != PROJECTED:
        outcome, note = with_magnitude(
            settings, outcome, d.mean, u.mean, paired[0] if paired else None
        )
    return SummaryRow(
        spec=spec.name,
        title=spec.title,
        threat=settings.threat,
        attack=defended[0].attack,
        paper=settings.paper or spec.claim,
        defended=d,
        undefended=u,
        delta=delta if delta is not None else describe([d.mean - u.mean]),
        peers=peers,
        guarantee=guarantee,
        verdict=outcome,
        utility_cost=utility_cost,
        note=note,
        interval=paired[0] if paired is not None else None,
    )


def markdown_summary(rows: Sequence[SummaryRow], metric_names: Sequence[str]) -> str:
    """The summary table in Markdown."""
    lines = [
        "| defense (spec) | threat | attack | paper's claim | metric | ours: defended "
        "| baseline | paired Δ | utility Δ | peers | guarantee | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row, metric in zip(rows, metric_names, strict=True):
        peers = "; ".join(f"{name}: {show(s)}" for name, s in row.peers) or "–"
        guarantee = (
            f"{row.guarantee[0]} = {show(row.guarantee[1])}" if row.guarantee else "–"
        )
        cost = (
            f"{row.utility_cost[0]}: {show(row.utility_cost[1])}"
            if row.utility_cost
            else "–"
        )
        verdict_cell = f"**{row.verdict}**" + (f" ({row.note})" if row.note else "")
        if row.interval is not None:
            verdict_cell += f" (paired Δ {row.interval})"
        lines.append(
            f"| {row.title} (`{row.spec}`) | {row.threat} | {row.attack} | {row.paper} "
            f"| {metric} | {show(row.defended)} | {show(row.undefended)} "
            f"| {show(row.delta)} | {cost} | {peers} | {guarantee} | {verdict_cell} |"
        )
    return "\n".join(lines)
