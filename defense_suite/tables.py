"""Markdown tables of results: per-arm means over seeds and paired deltas."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from defenses.results import SECTIONS, Result, Summary, paired_deltas, summarize

HEAD = ("scenario", "attack", "defense", "seeds")


def default_columns(results: Sequence[Result]) -> list[str]:
    """Every utility and success metric that the results report, in first-seen order."""
    seen: dict[str, None] = {}
    for result in results:
        for section in ("utility", "success"):
            for key in getattr(result, section):
                seen.setdefault(f"{section}.{key}", None)
    return list(seen)


def check_metrics(results: Sequence[Result], metrics: Sequence[str], flag: str) -> None:
    """Refuse a metric no result reports, listing the metrics that are present.

    Raises
    ------
    ValueError
        Naming ``flag``, the unknown metric and every ``section.key`` the results
        hold.
    """
    present = dict.fromkeys(
        f"{section}.{key}"
        for result in results
        for section in SECTIONS
        for key in getattr(result, section)
    )
    for metric in metrics:
        if metric not in present:
            raise ValueError(
                f"{flag}: no result reports the metric {metric!r}; metrics present: "
                f"{', '.join(present)}"
            )


def show(summary: Summary) -> str:
    """``mean ± std`` to three decimals, or the mean alone when the spread is zero.

    A deterministic result (every seed gave the same value, or one seed) has no
    spread to show: ``0.896``, not ``0.896 ± 0.000``.
    """
    if summary.std == 0.0:
        return f"{summary.mean:.3f}"
    return f"{summary.mean:.3f} ± {summary.std:.3f}"


def _cell(summary: Summary | None) -> str:
    return "–" if summary is None else show(summary)


SETTING_SECTIONS = ("scenario", "benchmark")


def varying_settings(results: Sequence[Result]) -> dict[str, list[str]]:
    """Per setting section, the parameter names whose values differ between results."""
    varying = {}
    for section in SETTING_SECTIONS:
        settings = [r.params.get(section, {}) for r in results]
        keys = dict.fromkeys(k for s in settings for k in s)
        varying[section] = [
            k
            for k in keys
            if len({json.dumps(s.get(k), sort_keys=True) for s in settings}) > 1
        ]
    return varying


def setting_label(result: Result, varying: dict[str, list[str]]) -> str:
    """The scenario name with the parameters that vary across the table."""
    shown = [
        f"{k}={result.params.get(section, {}).get(k)}"
        for section in SETTING_SECTIONS
        for k in varying.get(section, [])
    ]
    return f"{result.scenario}({', '.join(shown)})" if shown else result.scenario


def _render(
    rows: list[tuple[Result, dict[str, Summary | None]]], columns: Sequence[str]
) -> str:
    lines = [
        "| " + " | ".join((*HEAD, *columns)) + " |",
        "|" + "---|" * (len(HEAD) + len(columns)),
    ]
    varying = varying_settings([first for first, _ in rows])
    for first, cells in rows:
        n = max((c.n for c in cells.values() if c is not None), default=0)
        head = (setting_label(first, varying), first.attack, first.defense, str(n))
        lines.append(
            "| " + " | ".join((*head, *(_cell(cells[c]) for c in columns))) + " |"
        )
    return "\n".join(lines)


def markdown_table(results: Iterable[Result], columns: Sequence[str]) -> str:
    """Mean ± sample std over seeds of each column, one row per arm."""
    return _render(summarize(results, columns), columns)


def markdown_deltas(results: Iterable[Result], columns: Sequence[str]) -> str:
    """Paired deltas (defended minus undefended, same seed), a row per defended arm."""
    rows = paired_deltas(results, columns)
    if not rows:
        return ""
    return _render(rows, columns)
