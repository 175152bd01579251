r"""RPS's partition for a data size and a wanted radius, and a warning when it fails.

:func:`suggest_parts` turns the counting arguments of the certificate
(:mod:`defenses.rps.certificate`) into necessary conditions on ``n_train_parts``
(:math:`k_t`) and ``n_calib_parts`` (:math:`k_c`), and picks a partition that meets
them for the data at hand.

**Calibration side** (exact conditions of the certificate). With
:math:`\hat\tau = \hat\tau(\alpha, k_c)` (:func:`~defenses.rps.quantile.
majority_threshold`), a class in the set can be certified against :math:`r_c`
poisoned calibration points only if :math:`k_c - \hat\tau - 1 \ge r_c` (all
:math:`k_c` part sets hold it and :math:`r_c` of them may flip), a class out of it
only if :math:`\hat\tau \ge r_c`, and every part must keep a valid rank after
:math:`r_c` deletions: :math:`\min_i n_i - n_{\min}(\alpha, k_c) \ge r_c`. Parts of a
hash partition of :math:`n_c` points have sizes
:math:`\mathrm{Binomial}(n_c, 1 / k_c)`, so by the union bound

.. math::

    P\big(\min_i n_i < m\big) \le k_c\, F_{\mathrm{Bin}}(m - 1;\, n_c,\, 1 / k_c),

and the suggestion is the smallest :math:`k_c` (largest parts) meeting the first two
conditions whose bound for :math:`m = n_{\min} + r_c` is at most 5 %.

**Training side** (a vote margin, then the data). :math:`r_t` poisoned training
points move at most :math:`r_t` votes. A class in the set must keep its place while
:math:`r_t` of its votes leave and the threshold rises by up to :math:`r_t` votes
(the calibration points' votes move too); a class out of it must stay out while
:math:`r_t` votes join it and the threshold falls by :math:`r_t`. A set that is
neither empty nor full therefore needs :math:`4 r_t` votes between its members and
the rest, :math:`k_t \ge 4 r_t + 1`. With raw vote fractions (``softmax=False``,
:math:`s = v_y / k_t`) this is exact: the bounds are :math:`(v \pm r_t) / k_t`
clipped to [0, 1], monotone maps that commute with the order statistics behind
the thresholds, so an in-class needs :math:`v_y - r_t \ge t + r_t` and an
out-class :math:`v_z + r_t < t - r_t` for the majority threshold's vote count
:math:`t`; with the softmax a test checks it over every vote vector of three
classes against random calibration designs. Such a set certifies at most
:math:`\lfloor (k_t - 1) / 4 \rfloor` (on digits, 10 parts certified 0.60 of the test
points at :math:`r_t = 2` and none at 3). Above that minimum, more parts give finer
votes and larger margins until each part has too little data to learn. Measured
(logistic-regression parts, one calibration part, robust share of the test points
at :math:`r_t = 1`; ``docs/rps.md`` has the table): digits (898 training points,
10 classes) 0.85 at 10 parts, 0.91 at 30, 0.88 at 50, 0.78 at 150; a 5-class
synthetic task (1,500 points) 0 at the default 10, 0.48 at 50, 0.66 at 100-150; a
3-class one (600 points) 0.10 at 10, 0.58 at 50, 0.70 at 100. About two training
points of each class per part is near the best in all three, so the suggestion is
:math:`k_t = \max(4 r_t + 1, \min(\lfloor n_t / (2 K) \rfloor, 100))` (the cap
bounds the cost of training and certifying).

:class:`EmptyCertificateWarning` is raised by ``conformalize`` when no calibration
point's whole set is certified against one poisoned training point (or one
calibration point): the partition certifies nothing, and the message names the
suggestion.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy import stats

from defenses.checks import check_fraction, check_int
from defenses.rps.certificate import PartThresholds, ScoreGeometry
from defenses.rps.quantile import (
    QUANTILE_MODES,
    QuantileMode,
    majority_threshold,
    minimum_part_size,
)

POINTS_PER_CLASS = 2
"""Training points of each class per part that the training rule aims for."""
SMALL_PART_RISK = 0.05
"""Largest union-bound probability accepted for a calibration part too small."""


class EmptyCertificateWarning(UserWarning):
    """The chosen partition certifies no set against a single poisoned point."""


@dataclass(frozen=True)
class PartPlan:
    r"""A suggested partition and what it can certify at most.

    Attributes
    ----------
    n_train_parts, n_calib_parts : int
        The suggestion (``k_t``, ``k_c``).
    max_train_radius : int
        :math:`\lfloor (k_t - 1) / 4 \rfloor`: the largest training radius a set
        that is neither empty nor full can be certified at.
    max_calib_radius : int
        :math:`\min(k_c - \hat\tau - 1, \hat\tau)` (0 with one part).
    min_calib_part : int
        Points a calibration part needs for its rank, :math:`n_{\min}`.
    feasible : bool
        Whether the data meet every condition for the wanted radii.
    notes : tuple of str
        Why, in words (what limits the radius, how much data would be needed).
    """

    n_train_parts: int
    n_calib_parts: int
    max_train_radius: int
    max_calib_radius: int
    min_calib_part: int
    feasible: bool
    notes: tuple[str, ...]


def calib_cap(k_c: int, alpha: float) -> int:
    """Largest calibration radius a non-trivial set can reach with ``k_c`` parts."""
    if k_c == 1:
        return 0
    tau = majority_threshold(k_c, alpha)
    return max(0, min(k_c - tau - 1, tau))


def small_part_risk(n: int, k_c: int, size: int) -> float:
    """Union bound on P(some hash part of ``n`` points into ``k_c`` has < size)."""
    if k_c == 1:
        return 0.0 if n >= size else 1.0
    return min(1.0, k_c * float(stats.binom.cdf(size - 1, n, 1.0 / k_c)))


def _calibration(
    n_calib: int, radius: int, alpha: float, quantile: QuantileMode
) -> tuple[int, int, bool, str]:
    """(k_c, n_min, feasible, note) for the wanted calibration radius."""
    if radius == 0:
        return 1, minimum_part_size(alpha, 1, quantile), True, "no calibration radius"
    k_c = 2
    while calib_cap(k_c, alpha) < radius:
        k_c += 1
    first = k_c
    while k_c <= max(first, n_calib):
        need = minimum_part_size(alpha, k_c, quantile) + radius
        if small_part_risk(n_calib, k_c, need) <= SMALL_PART_RISK:
            return (
                k_c,
                need - radius,
                True,
                f"{k_c} calibration parts reach r_c={radius}",
            )
        if n_calib // k_c < need:
            break
        k_c += 1
    need = minimum_part_size(alpha, first, quantile) + radius
    rows = need * first
    while small_part_risk(rows, first, need) > SMALL_PART_RISK:
        rows += first
    return (
        first,
        need - radius,
        False,
        f"r_c={radius} needs {first} calibration parts of at least {need} points: "
        f"about {rows} calibration points (have {n_calib})",
    )


def suggest_parts(
    n_train: int,
    n_calib: int,
    n_classes: int,
    train_radius: int = 1,
    calib_radius: int = 1,
    confidence_level: float = 0.9,
    quantile: QuantileMode = "exact",
    max_train_parts: int = 100,
) -> PartPlan:
    r"""``n_train_parts`` / ``n_calib_parts`` for the data size and wanted radii.

    Parameters
    ----------
    n_train, n_calib : int
        Training and calibration points.
    n_classes : int
        K >= 2.
    train_radius, calib_radius : int
        Poisoned training / calibration points the sets should withstand (>= 0).
    confidence_level : float
        :math:`1 - \alpha` in (0, 1).
    quantile : {"exact", "official", "markov"}
        The rank rule (it sets the calibration parts' minimum size).
    max_train_parts : int
        Cap on the data rule (training and ``certify`` cost grow with ``k_t``);
        never below :math:`4 r_t + 1`.

    Returns
    -------
    PartPlan
        The suggestion, its caps and notes; ``feasible`` is False when the data are
        too few for the wanted radii (the notes say how many would do).
    """
    n_t = check_int("n_train", n_train, 1)
    n_c = check_int("n_calib", n_calib, 1)
    k = check_int("n_classes", n_classes, 2)
    r_t = check_int("train_radius", train_radius, 0)
    r_c = check_int("calib_radius", calib_radius, 0)
    level = check_fraction("confidence_level", confidence_level)
    if quantile not in QUANTILE_MODES:
        raise ValueError(f"quantile must be one of {QUANTILE_MODES}, got {quantile!r}")
    cap = check_int("max_train_parts", max_train_parts, 1)
    alpha = 1.0 - level
    notes: list[str] = []
    feasible = True
    margin = 4 * r_t + 1 if r_t else 1
    by_data = min(n_t // (POINTS_PER_CLASS * k), cap)
    k_t = max(margin, by_data) if r_t else 1
    k_t = min(k_t, n_t)
    if r_t == 0:
        notes.append("no training radius: one model (n_train_parts=1)")
    elif by_data < margin:
        feasible = n_t >= margin
        notes.append(
            f"r_t={r_t} needs at least {margin} training parts (4 r_t + 1 votes); "
            f"{n_t} points give {n_t / margin:.1f} a part, fewer than "
            f"{POINTS_PER_CLASS} of each of {k} classes: expect weak parts and few "
            f"certified points (about {margin * POINTS_PER_CLASS * k} training "
            "points would do)"
        )
    else:
        notes.append(
            f"{k_t} training parts: about {POINTS_PER_CLASS} points of each class a "
            f"part, at least {margin} for r_t={r_t}"
        )
    k_c, n_min, ok, note = _calibration(n_c, r_c, alpha, quantile)
    feasible = feasible and ok
    notes.append(note)
    return PartPlan(
        n_train_parts=int(k_t),
        n_calib_parts=int(k_c),
        max_train_radius=(k_t - 1) // 4 if k_t > 1 else 0,
        max_calib_radius=calib_cap(k_c, alpha),
        min_calib_part=int(n_min),
        feasible=feasible,
        notes=tuple(notes),
    )


def robust_share(
    thresholds: PartThresholds,
    geometry: ScoreGeometry,
    train_radius: int,
    calib_radius: int,
) -> float:
    """Share of the batch's points whose whole set is certified at (r_t, r_c)."""
    in_set = np.asarray(geometry.score() >= thresholds.cut)
    ok = thresholds.certified(geometry, in_set, train_radius, calib_radius)
    return float(np.mean(ok[geometry.index].all(axis=1)))


def warn_if_empty(
    thresholds: PartThresholds,
    geometry: ScoreGeometry,
    train_side: bool,
    sizes: tuple[int, int, int],
    confidence_level: float,
) -> None:
    """Warn when no calibration point's set is certified against one poison.

    ``train_side``: whether the training certificate applies (``k_t > 1`` and a
    training radius was computed); ``sizes``: (n_train, or 0 when unknown as for
    a voter, n_calib, K).
    """
    n_train, n_calib, n_classes = sizes
    empty = []
    if train_side and robust_share(thresholds, geometry, 1, 0) == 0.0:
        empty.append("one poisoned training point")
    if thresholds.n_parts > 1 and robust_share(thresholds, geometry, 0, 1) == 0.0:
        empty.append("one poisoned calibration point")
    if not empty:
        return
    plan = suggest_parts(
        max(n_train, 1), n_calib, max(n_classes, 2), int(n_train > 0), 1,
        confidence_level,
    )  # fmt: skip
    train = f"n_train_parts={plan.n_train_parts}, " if n_train else ""
    notes = plan.notes if n_train else plan.notes[1:]
    warnings.warn(
        f"RPS certifies nothing: no calibration point's set is robust to "
        f"{' or '.join(empty)} at this partition (confidence_level="
        f"{confidence_level:g}). suggest_parts for these data suggests {train}"
        f"n_calib_parts={plan.n_calib_parts} ({'; '.join(notes)})",
        EmptyCertificateWarning,
        stacklevel=4,
    )


__all__ = [
    "EmptyCertificateWarning",
    "PartPlan",
    "robust_share",
    "suggest_parts",
    "warn_if_empty",
]
