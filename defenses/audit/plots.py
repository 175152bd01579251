"""The audit's plots: log-log ROC per attack and arm, utility against attack success.

In the style of the benchmark report's plots (``results/plots``): one panel per
attack, the undefended arm as a star (or a solid line), every defended arm labelled.
The ROC is drawn on log-log axes, where the low-FPR regime that matters for
membership inference (Carlini et al., 2022) is visible; the chance line is the
diagonal. The trade-off panels share their axis ranges, so panels can be compared at
a glance: test accuracy from :func:`accuracy_range` (at least
:data:`MIN_ACCURACY_SPAN` wide, up to 1) on every panel, AUC from 0.4 to 1 with the
chance line at 0.5, and inversion accuracy from 0 to 1.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from defenses.audit.verdict import HEADLINE
from defenses.plotting import save_figure
from defenses.results import UNDEFENDED, Summary, summarize
from defenses.tradeoff_points import draw_arm_point

if TYPE_CHECKING:
    from defenses.audit.findings import Findings

LOG_FLOOR = 1e-4
"""Rates are drawn from here up (log axes cannot show 0)."""

PANELS_PER_ROW = 4
"""Panels of the trade-off plot per row."""

MIN_ACCURACY_SPAN = 0.2
"""Narrowest test-accuracy axis of the trade-off plot (no zoom into rounding)."""

SUCCESS_RANGE = {"success.auc": (0.4, 1.0), "success.acc@1": (0.0, 1.0)}
"""The fixed axis of each headline success metric."""


def accuracy_range(values: list[float]) -> tuple[float, float]:
    """A test-accuracy axis holding ``values``, >= ``MIN_ACCURACY_SPAN`` wide, to 1."""
    low = min([*values, 1.0]) - 0.02
    low = math.floor(min(low, 1.0 - MIN_ACCURACY_SPAN) * 20) / 20
    return max(low, 0.0), 1.01


def _mean(summary: Summary | None) -> float:
    return math.nan if summary is None else summary.mean


def _success_range(metric: str, values: list[float]) -> tuple[float, float]:
    low, high = SUCCESS_RANGE.get(metric, (0.0, 1.0))
    if values:
        low = min(low, min(values) - 0.02)
        high = max(high, max(values) + 0.02)
    return low, high + 0.02


def roc_plot(report: Findings, out: Path) -> Path:
    """Log-log ROC curves, a panel per membership attack, a colour per arm."""
    attacks = list(dict.fromkeys(c.attack for c in report.curves))
    arms = list(dict.fromkeys(c.defense for c in report.curves))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(
        1, len(attacks), figsize=(4.6 * len(attacks), 4.2), squeeze=False
    )
    for ax, attack in zip(axes[0], attacks, strict=True):
        for i, arm in enumerate(arms):
            curves = [
                c for c in report.curves if c.attack == attack and c.defense == arm
            ]
            for j, curve in enumerate(curves):
                ax.plot(
                    np.maximum(curve.fpr, LOG_FLOOR),
                    np.maximum(curve.tpr, LOG_FLOOR),
                    color=colours[i % len(colours)],
                    linestyle="-" if arm == UNDEFENDED else "--",
                    alpha=0.8 if j == 0 else 0.35,
                    label=arm if j == 0 else None,
                )
        ax.plot([LOG_FLOOR, 1], [LOG_FLOOR, 1], color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(LOG_FLOOR, 1)
        ax.set_ylim(LOG_FLOOR, 1.05)
        ax.set_xlabel("false positive rate")
        ax.set_ylabel("true positive rate")
        ax.set_title(attack)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"{report.name}: membership ROC (one line per seed)")
    return save_figure(fig, out)


def tradeoff_plot(report: Findings, out: Path) -> Path | None:
    """Test accuracy against each attack's headline success (mean ± std over seeds)."""
    panels = []
    for kind, metric in HEADLINE.items():
        runs = report.of_kind(kind)
        for attack in dict.fromkeys(r.attack for r in runs):
            panels.append((attack, metric, [r for r in runs if r.attack == attack]))
    if not panels:
        return None
    cols = min(PANELS_PER_ROW, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 3.8 * rows), squeeze=False
    )
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    x = "utility.accuracy"
    summaries = [summarize(runs, [x, metric]) for _, metric, runs in panels]
    xs = [_mean(c[x]) for rows_ in summaries for _, c in rows_ if c[x] is not None]
    x_range = accuracy_range(xs)
    for ax, (attack, metric, _), rows_ in zip(
        axes.flat, panels, summaries, strict=False
    ):
        for first, cells in rows_:
            draw_arm_point(ax, first.defense, cells[x], cells[metric], first.defense)
        ys = [_mean(c[metric]) for _, c in rows_ if c[metric] is not None]
        if metric == "success.auc":
            ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_xlim(*x_range)
        ax.set_ylim(*_success_range(metric, ys))
        ax.set_xlabel("test accuracy")
        ax.set_ylabel(metric.removeprefix("success."))
        ax.set_title(attack)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{report.name}: utility against attack success")
    return save_figure(fig, out)
