"""Writing the suite's figures: one home for the last steps of every plot.

Every package's figure function ends the same way: lay the panels out, write the PNG
(creating its folder), and close the figure so that a report with dozens of plots
does not keep them all in memory. :func:`save_figure` is that ending. It leaves the
backend alone: the figure exists already, drawn on the backend its caller chose (the
suite's figure modules pick the non-interactive ``Agg``), and switching backends
would close every open figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["save_figure"]


def save_figure(fig: Figure, path: Path, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` at ``dpi``, close it; return ``path``.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
        The finished figure (closed afterwards: do not draw on it again).
    path : Path
        The file to write; its folder is created if missing. The format follows the
        suffix (``.png`` throughout the suite).
    dpi : int
        Resolution in dots per inch.

    Returns
    -------
    Path
        ``path``, for the caller's ``(caption, path)`` list.
    """
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
