r"""The size a claim states, and whether a measurement reaches it.

A summary row's verdict (:mod:`defense_suite.summary`) first checks the direction
of the change, by at least the row's ``relative_change``. Where the paper states a
size, the spec's ``[report.summary]`` carries it in the metric's own units, and
the verdict also checks that size:

* ``paper_baseline`` and ``paper_defended``: the paper's values without and with
  the defense (BREP-MI accuracy 26.8 % -> 1.8 %: 0.268 and 0.018). Set-ups differ
  in scale, so the claim carried over is the relative change
  :math:`c_p = (d_p - b_p) / |b_p|`, and the measured change must reach
  :math:`c_p |u|` at our baseline mean :math:`u`;
* ``paper_defended`` alone: the value itself (the defended mean must reach it);
* ``paper_ratio`` :math:`r` (a speed-up, "6.94x faster"): the defended mean must
  reach :math:`u / r` (direction "lower") or :math:`r u` ("higher").

*Reaches* means at or beyond the stated size in the claimed direction, judged on
the mean: a claim is never called reproduced on an interval that merely holds its
size. When the mean falls short but the paired 95 % interval of the change holds
the stated size, the note says so (more seeds could tell).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from defenses.results import Interval

MAGNITUDE_KEYS = ("paper_baseline", "paper_defended", "paper_ratio")
"""The ``[report.summary]`` keys that state a claim's size."""

TOLERANCE = 1e-9
"""Relative slack for rounding when a mean sits exactly at the stated size."""


def magnitude_problem(
    direction: str,
    baseline: float | None,
    defended: float | None,
    ratio: float | None,
) -> str | None:
    """Why these magnitude keys do not make a claim, or None when they do.

    The answer starts with the offending key (the caller prefixes
    ``report.summary.``).
    """
    for key, value in zip(MAGNITUDE_KEYS, (baseline, defended, ratio), strict=True):
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            return f"{key} must be a finite number, got {value!r}"
    if baseline is None and defended is None and ratio is None:
        return None
    if direction not in ("lower", "higher"):
        return (
            f"{'paper_ratio' if ratio is not None else 'paper_defended'} states a "
            f"size, which needs direction 'lower' or 'higher', got {direction!r}"
        )
    if ratio is not None:
        if defended is not None or baseline is not None:
            return (
                "paper_ratio states the size alone: give it, or paper_defended "
                "(with paper_baseline), not both"
            )
        if ratio <= 1:
            return f"paper_ratio must be > 1 (6.94 for 6.94x), got {ratio!r}"
        return None
    if defended is None:
        return "paper_baseline needs paper_defended (the paper's defended value)"
    if baseline is not None:
        change = defended - baseline
        if baseline == 0 or (change >= 0 if direction == "lower" else change <= 0):
            return (
                f"paper_baseline {baseline!r} -> paper_defended {defended!r} must "
                f"move {direction} from a non-zero baseline"
            )
    return None


@dataclass(frozen=True)
class Magnitude:
    """A claim's stated size (see the module docstring)."""

    direction: str
    baseline: float | None = None
    defended: float | None = None
    ratio: float | None = None

    def target(self, ours: float) -> float:
        """The change (defended minus baseline) the claim states at our baseline."""
        if self.ratio is not None:
            lower = self.direction == "lower"
            return (ours / self.ratio if lower else ours * self.ratio) - ours
        if self.defended is None:
            raise ValueError("a magnitude needs paper_defended or paper_ratio")
        if self.baseline is None:
            return self.defended - ours
        return (self.defended - self.baseline) / abs(self.baseline) * abs(ours)

    def reached(self, change: float, ours: float) -> bool:
        """Whether a measured ``change`` reaches the stated size (with rounding)."""
        goal = self.target(ours)
        slack = TOLERANCE * max(abs(goal), abs(ours), 1e-12)
        return (
            change <= goal + slack
            if self.direction == "lower"
            else (change >= goal - slack)
        )

    def describe(self, defended: float, ours: float) -> str:
        """Ours against the paper's, in the claim's own terms."""
        if self.ratio is not None:
            mine = ours / defended if self.direction == "lower" else defended / ours
            shown = f"{mine:.3g}x" if math.isfinite(mine) and defended != 0 else "n/a"
            return f"{shown} against the paper's {self.ratio:.3g}x"
        text = f"{defended:.3g} against the paper's {self.defended:.3g}"
        if self.baseline is not None and self.defended is not None:
            paper = (self.defended - self.baseline) / abs(self.baseline)
            mine = (defended - ours) / max(abs(ours), 1e-12)
            text += (
                f" (paper {self.baseline:.3g} -> {self.defended:.3g}, {paper:+.0%}; "
                f"ours {ours:.3g} -> {defended:.3g}, {mine:+.0%})"
            )
        return text


def check(
    magnitude: Magnitude,
    defended: float,
    baseline: float,
    interval: Interval | None = None,
) -> tuple[bool, str]:
    """Whether the means reach the stated size, and the note that says how.

    ``interval`` is the paired interval of the change (defended minus baseline);
    when the mean falls short and the interval holds the stated change, the note
    says so.
    """
    met = magnitude.reached(defended - baseline, baseline)
    note = magnitude.describe(defended, baseline)
    if met:
        return True, f"{note}: magnitude reproduced"
    note += ": magnitude not reproduced"
    goal = magnitude.target(baseline)
    if interval is not None and interval.low <= goal <= interval.high:
        note += (
            f"; the stated change ({goal:+.3g} here) lies within the paired 95 % "
            "interval, so more seeds could tell"
        )
    return False, note
