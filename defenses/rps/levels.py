r"""Several confidence levels at once, as MAPIE 1.x's ``confidence_level=[...]``.

Each level :math:`1 - \alpha_l` has its own majority threshold
:math:`\hat\tau(\alpha_l, k_c)`, per-part ranks and thresholds; the calibration
points' score bounds do not depend on the level and are computed once
(:func:`~defenses.rps.calibration.score_bounds`). ``predict_set`` stacks the sets
along the last axis, ``(n, K, L)`` in the given order, as MAPIE does; ``certify``
certifies one level at a time, named by its ``confidence_level``.

With one level (a float) the fitted attributes are as before: ``tau_hat_`` an int,
``ranks_`` / ``thresholds_`` of shape ``(k_c,)``, ``guard_`` an int,
``miscoverage_bound_`` a float. With a list they gain a leading axis of length L
(``tau_hat_`` of shape ``(L,)``, ``thresholds_`` of shape ``(L, k_c)``, ...);
``part_thresholds_`` is the first level's, ``level_thresholds_`` holds them all.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from defenses.arrays import IntArray
from defenses.rps.calibration import Calibration, calibrate_parts, score_bounds
from defenses.rps.certificate import PartThresholds, ScoreGeometry
from defenses.rps.settings import Settings

LEVEL_ATTRIBUTES = (
    "tau_hat_",
    "calib_part_sizes_",
    "ranks_",
    "guard_",
    "part_thresholds_",
    "level_thresholds_",
    "thresholds_",
    "miscoverage_bound_",
)
"""What :func:`store` writes (and ``fit`` clears)."""


def calibrate_levels(
    parts: list[IntArray],
    entries: IntArray,
    geometry: ScoreGeometry,
    settings: Settings,
    max_train_radius: int,
) -> tuple[Calibration, ...]:
    """One :class:`~defenses.rps.calibration.Calibration` per confidence level."""
    bounds = score_bounds(entries, geometry, max_train_radius)
    return tuple(
        calibrate_parts(
            parts, entries, geometry, alpha, settings.quantile, max_train_radius, bounds
        )
        for alpha in settings.alphas
    )


def store(model: Any, calibrations: tuple[Calibration, ...], several: bool) -> None:
    """Write the fitted conformal attributes of ``model`` (see the module notes)."""
    first = calibrations[0]
    model.calib_part_sizes_ = first.sizes
    model.level_thresholds_ = tuple(c.part_thresholds for c in calibrations)
    model.part_thresholds_ = first.part_thresholds
    if not several:
        model.tau_hat_ = first.part_thresholds.tau_hat
        model.ranks_ = first.ranks
        model.guard_ = first.guard
        model.thresholds_ = first.thresholds
        model.miscoverage_bound_ = first.miscoverage_bound
        return
    model.tau_hat_ = np.array([c.part_thresholds.tau_hat for c in calibrations])
    model.ranks_ = np.stack([c.ranks for c in calibrations])
    model.guard_ = np.array([c.guard for c in calibrations])
    model.thresholds_ = np.stack([c.thresholds for c in calibrations])
    model.miscoverage_bound_ = np.array([c.miscoverage_bound for c in calibrations])


def pick_level(
    levels: tuple[PartThresholds, ...],
    alphas: tuple[float, ...],
    several: bool,
    confidence_level: float | None,
) -> PartThresholds:
    """The thresholds of the level named ``confidence_level`` (None: the only one).

    Raises
    ------
    ValueError
        None with several levels, or a level that was not conformalized.
    """
    given = tuple(round(1.0 - a, 12) for a in alphas)
    if confidence_level is None:
        if several:
            raise ValueError(
                f"confidence_level={list(given)} gives one set per level: name the "
                f"one to certify, e.g. certify(X, confidence_level={given[-1]})"
            )
        return levels[0]
    for level, thresholds in zip(given, levels, strict=True):
        if abs(level - float(confidence_level)) <= 1e-9:
            return thresholds
    raise ValueError(
        f"confidence_level={confidence_level!r} was not conformalized; the levels "
        f"are {list(given)}"
    )
