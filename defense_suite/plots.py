"""Plots for the report: one metric against another per arm, and paired changes.

Axes are named in words (:mod:`defense_suite.labels`), titles are wrapped to the
figure's width, and runs that differ in a scenario or benchmark setting (data set,
model, budget) get their own panel or bar group, labelled by the settings that differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from defense_suite.labels import delta_label, fit_title, metric_label
from defense_suite.tables import SETTING_SECTIONS, varying_settings
from defenses.results import Result, Summary, paired_deltas, summarize
from defenses.tradeoff_points import draw_arm_point


def setting_words(result: Result, varying: dict[str, list[str]]) -> str:
    """``dataset=digits, model=mlp``: the settings of ``result`` that vary."""
    return ", ".join(
        f"{k}={result.params.get(section, {}).get(k)}"
        for section in SETTING_SECTIONS
        for k in varying.get(section, [])
    )


def _panels(results: Sequence[Result]) -> dict[str, list[Result]]:
    varying = varying_settings(results)
    panels: dict[str, list[Result]] = {}
    for result in results:
        words = setting_words(result, varying)
        name = "\n".join(p for p in (f"attack: {result.attack}", words) if p)
        panels.setdefault(name, []).append(result)
    return panels


def _save(fig: Figure, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def tradeoff_plot(
    results: Sequence[Result], x: str, y: str, out: Path, title: str = ""
) -> Path:
    """Write :func:`tradeoff_figure` to ``out`` (PNG); return the path."""
    return _save(tradeoff_figure(results, x, y, title), out)


def delta_plot(
    results: Sequence[Result], metric: str, out: Path, title: str = ""
) -> Path | None:
    """Write :func:`delta_figure` to ``out`` (PNG); None if there is nothing to plot."""
    fig = delta_figure(results, metric, title)
    return None if fig is None else _save(fig, out)


def tradeoff_figure(
    results: Sequence[Result], x: str, y: str, title: str = ""
) -> Figure:
    """Scatter ``y`` against ``x`` per arm (mean ± std over seeds).

    One panel per attack and per scenario setting that differs (data set, model,
    budget); the undefended arm is a star, every defended arm a labelled point.
    """
    panels = _panels(results)
    width = min(5.2 * len(panels), 16.0)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(width, 4.4), squeeze=False, sharey=True
    )
    for ax, (name, runs) in zip(axes[0], panels.items(), strict=True):
        rows = summarize(runs, [x, y])
        legend = len(rows) <= 12
        for first, cells in rows:
            cx, cy = cells[x], cells[y]
            if cx is None or cy is None:
                continue
            draw_arm_point(ax, first.defense, cx, cy, first.defense if legend else None)
            if not legend:
                ax.annotate(first.defense, (cx.mean, cy.mean), fontsize=6)
        ax.set_xlabel(metric_label(x))
        if name:
            ax.set_title(name, fontsize=8)
        ax.grid(alpha=0.3)
        if legend:
            ax.legend(fontsize=7)
    axes[0][0].set_ylabel(metric_label(y))
    if title:
        fig.suptitle(fit_title(title, width), fontsize=10)
    fig.tight_layout()
    return fig


def delta_figure(
    results: Sequence[Result], metric: str, title: str = ""
) -> Figure | None:
    """Bars of the paired change (defended minus undefended, same seed) of ``metric``.

    One bar per defended arm with the standard deviation over seeds as its error
    bar; each bar's label names the attack (when several ran) and the scenario
    settings that differ between bars. Returns None when no defended arm has an
    undefended partner.
    """
    rows: list[tuple[Result, Summary]] = []
    for first, cells in paired_deltas(results, [metric]):
        summary = cells[metric]
        if summary is not None:
            rows.append((first, summary))
    if not rows:
        return None
    varying = varying_settings([first for first, _ in rows])
    several = len({first.attack for first, _ in rows}) > 1
    labels = [
        "\n".join(
            part
            for part in (
                setting_words(first, varying),
                first.attack if several else "",
                first.defense,
            )
            if part
        )
        for first, _ in rows
    ]
    width = min(max(5.5, 1.0 * len(rows) + 2), 16.0)
    fig, ax = plt.subplots(figsize=(width, 4.6))
    positions = list(range(len(rows)))
    ax.bar(
        positions,
        [s.mean for _, s in rows],
        yerr=[s.std for _, s in rows],
        capsize=3,
        color="tab:blue",
        alpha=0.8,
    )
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(positions)
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(delta_label(metric), fontsize=8)
    ax.set_title(fit_title(title or delta_label(metric), width), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
