"""One arm's point on a utility/attack-success trade-off plot.

The suite's trade-off plots (the benchmark report's ``defense_suite.plots`` and the
audit's :func:`defenses.audit.plots.tradeoff_plot`) draw every arm the same way: at
the mean of its two metrics over seeds, with one-standard-deviation error bars, the
undefended arm (:data:`~defenses.results.UNDEFENDED`) as a large star and every
defended arm as a dot. This module is that drawing's one home.
"""

from __future__ import annotations

from typing import Any

from defenses.results import UNDEFENDED, Summary

__all__ = ["draw_arm_point"]


def draw_arm_point(
    ax: Any,
    defense: str,
    x: Summary | None,
    y: Summary | None,
    label: str | None,
) -> bool:
    """Draw ``(x.mean, y.mean)`` with error bars ``x.std``, ``y.std`` on ``ax``.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
        The panel.
    defense : str
        The arm's defense name; :data:`~defenses.results.UNDEFENDED` is a star.
    x, y : Summary or None
        The arm's summaries of the two plotted metrics; None when the arm does not
        report the metric (nothing is drawn).
    label : str or None
        Legend entry (None: none).

    Returns
    -------
    bool
        Whether the point was drawn (both summaries present).
    """
    if x is None or y is None:
        return False
    undefended = defense == UNDEFENDED
    ax.errorbar(
        x.mean,
        y.mean,
        xerr=x.std,
        yerr=y.std,
        fmt="*" if undefended else "o",
        markersize=12 if undefended else 6,
        capsize=3,
        label=label,
    )
    return True
