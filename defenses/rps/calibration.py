r"""Per-part conformal thresholds of RPS and their worst case under poisoning.

Scholten & Günnemann, ICLR 2025 (Alg. 2). The calibration data are hash-partitioned
into :math:`k_c` parts; part :math:`i` with :math:`n_i` points and rank
:math:`j_i` (:func:`defenses.rps.quantile.part_rank`) has the threshold
:math:`\tau_i`, the :math:`j_i`-th smallest of its calibration scores
:math:`s(x, y)`. For each training radius :math:`r \le r_{\max}` the poisoned
threshold lies in :math:`[\tau_i^{lo}(r), \tau_i^{up}(r)]`: the :math:`j_i`-th
smallest of the points' lower (upper) score bounds after :math:`r` changed votes,
since order statistics are monotone (:mod:`defenses.rps.certificate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from defenses.arrays import FloatArray, IntArray
from defenses.rps.certificate import PartThresholds, ScoreGeometry
from defenses.rps.quantile import (
    QuantileMode,
    majority_miscoverage,
    majority_threshold,
    minimum_part_size,
    part_rank,
)


@dataclass(frozen=True)
class Calibration:
    r"""What calibrating the parts yields.

    Attributes
    ----------
    sizes : int array of shape (k_c,)
        Points per calibration part, :math:`n_i`.
    ranks : int array of shape (k_c,)
        Rank :math:`j_i` of each part's threshold.
    guard : int
        :math:`\min_i n_i - n_{\min}`: calibration deletions every part survives.
    part_thresholds : PartThresholds
        Sorted threshold bounds per training radius (for the sets and certificates).
    thresholds : float array of shape (k_c,)
        The clean thresholds :math:`\tau_i` in part order.
    miscoverage_bound : float
        Exact miscoverage of the majority set for these ranks and sizes.
    """

    sizes: IntArray
    ranks: IntArray
    guard: int
    part_thresholds: PartThresholds
    thresholds: FloatArray
    miscoverage_bound: float


def _fitting_advice(n_calib: int, alpha: float, quantile: QuantileMode) -> str:
    """What fits ``n_calib`` calibration points: the advice of ``suggest_parts``."""
    from defenses.rps.advice import _calibration

    level = f"confidence_level={1 - alpha:.6g}"
    k_c, n_min, feasible, _ = _calibration(n_calib, 1, alpha, quantile)
    hint = (
        f"n_calib_parts={k_c} (parts of at least {n_min} points) fits "
        f"{n_calib} calibration points and certifies one poisoned calibration point"
        if feasible
        else f"n_calib_parts=1 fits {n_calib} calibration points (no calibration "
        "radius; more calibration data would buy one)"
    )
    return (
        f"Use more calibration data or fewer n_calib_parts: {hint}; "
        f"suggest_parts(n_train, n_calib={n_calib}, n_classes, {level}) proposes "
        "both partitions for your data (from defenses.rps import suggest_parts)"
    )


def score_bounds(
    entries: IntArray, geometry: ScoreGeometry, max_train_radius: int
) -> tuple[FloatArray, FloatArray]:
    """Lower and upper score bounds of ``entries`` at radii ``0..max_train_radius``.

    Shape (n, R + 1) each; column 0 is the score itself. They do not depend on the
    confidence level, so several levels share them.
    """
    steps = max_train_radius + 1
    cal_lower = np.empty((entries.size, steps))
    cal_upper = np.empty((entries.size, steps))
    cal_lower[:, 0] = cal_upper[:, 0] = geometry.score()[entries]
    for r in range(1, steps):
        cal_lower[:, r] = geometry.lower(r, rows=entries)
        cal_upper[:, r] = geometry.upper(r, rows=entries)
    return cal_lower, cal_upper


def calibrate_parts(
    parts: list[IntArray],
    entries: IntArray,
    geometry: ScoreGeometry,
    alpha: float,
    quantile: QuantileMode,
    max_train_radius: int,
    bounds: tuple[FloatArray, FloatArray] | None = None,
) -> Calibration:
    """Thresholds of each calibration part and their range up to ``max_train_radius``.

    Parameters
    ----------
    parts : list of int arrays
        Row indices of each calibration part (a partition of the points).
    entries : int array of shape (n,)
        Entry of ``geometry`` holding each calibration point's true class.
    geometry : ScoreGeometry
        Scores of the calibration points and their bounds.
    alpha : float
        Miscoverage level in (0, 1).
    quantile : {"exact", "official", "markov"}
        Rank rule of the parts.
    max_train_radius : int
        Largest training radius the thresholds' worst case is computed for.
    bounds : pair of float arrays or None
        :func:`score_bounds` of ``entries``, if already computed.

    Raises
    ------
    ValueError
        If a part is too small for a rank under ``quantile`` at ``alpha``.
    """
    k_c = len(parts)
    sizes = np.array([p.size for p in parts], dtype=np.int64)
    ranks = np.array(
        [part_rank(int(n), alpha, k_c, quantile) for n in sizes], dtype=np.int64
    )
    n_min = minimum_part_size(alpha, k_c, quantile)
    if np.any(ranks < 1):
        worst = int(np.argmin(sizes))
        advice = _fitting_advice(int(sizes.sum()), alpha, quantile)
        raise ValueError(
            f"calibration part {worst} holds {sizes[worst]} points; quantile "
            f"{quantile!r} at confidence_level={1 - alpha:.6g} with {k_c} parts needs "
            f"at least {n_min} per part. {advice}"
        )
    steps = max_train_radius + 1
    if bounds is None:
        bounds = score_bounds(entries, geometry, max_train_radius)
    cal_lower, cal_upper = bounds
    if cal_lower.shape != (entries.size, steps):
        raise ValueError(
            f"bounds must have shape ({entries.size}, {steps}), got {cal_lower.shape}"
        )
    tau_lower = np.empty((k_c, steps))
    tau_upper = np.empty((k_c, steps))
    for i, (members, rank) in enumerate(zip(parts, ranks, strict=True)):
        tau_lower[i] = np.sort(cal_lower[members], axis=0)[rank - 1]
        tau_upper[i] = np.sort(cal_upper[members], axis=0)[rank - 1]
    guard = int(sizes.min() - n_min)
    return Calibration(
        sizes=sizes,
        ranks=ranks,
        guard=guard,
        part_thresholds=PartThresholds(
            np.sort(tau_lower, axis=0),
            np.sort(tau_upper, axis=0),
            majority_threshold(k_c, alpha),
            guard,
        ),
        thresholds=tau_lower[:, 0].copy(),
        miscoverage_bound=majority_miscoverage(ranks, sizes, alpha),
    )
