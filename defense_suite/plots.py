"""Plots for the report: utility against attack success, with error bars over seeds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from defenses.results import UNDEFENDED, Result, Summary, paired_deltas, summarize


def tradeoff_plot(
    results: Sequence[Result], x: str, y: str, out: Path, title: str = ""
) -> Path:
    """Scatter ``y`` against ``x`` per arm (mean ± std over seeds), a panel per attack.

    The undefended arm is a star; every defended arm a labelled point.
    """
    attacks = list(dict.fromkeys(r.attack for r in results))
    fig, axes = plt.subplots(
        1, len(attacks), figsize=(5.2 * len(attacks), 4.2), squeeze=False
    )
    for ax, attack in zip(axes[0], attacks, strict=True):
        rows = summarize([r for r in results if r.attack == attack], [x, y])
        for first, cells in rows:
            cx, cy = cells[x], cells[y]
            if cx is None or cy is None:
                continue
            undefended = first.defense == UNDEFENDED
            ax.errorbar(
                cx.mean,
                cy.mean,
                xerr=cx.std,
                yerr=cy.std,
                fmt="*" if undefended else "o",
                markersize=12 if undefended else 6,
                capsize=3,
                label=first.defense if len(rows) <= 12 else None,
            )
            if len(rows) > 12:
                ax.annotate(first.defense, (cx.mean, cy.mean), fontsize=6)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(attack)
        ax.grid(alpha=0.3)
        if len(rows) <= 12:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def delta_plot(
    results: Sequence[Result], metric: str, out: Path, title: str = ""
) -> Path | None:
    """Bars of the paired delta (defended minus undefended, same seed) of ``metric``.

    One bar per defended arm, grouped by attack, with the standard deviation over
    seeds as the error bar. Returns None when no defended arm has an undefended
    partner.
    """
    rows: list[tuple[Result, Summary]] = []
    for first, cells in paired_deltas(results, [metric]):
        summary = cells[metric]
        if summary is not None:
            rows.append((first, summary))
    if not rows:
        return None
    labels = [f"{first.attack}\n{first.defense}" for first, _ in rows]
    means = [summary.mean for _, summary in rows]
    stds = [summary.std for _, summary in rows]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(rows) + 2), 4.2))
    positions = range(len(rows))
    ax.bar(positions, means, yerr=stds, capsize=3, color="tab:blue", alpha=0.8)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(list(positions))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(f"paired Δ {metric}")
    ax.set_title(title or f"paired Δ {metric}", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
