r"""Checks of a restored RPS classifier: shapes, and everything the state implies.

A served RPS model (:mod:`defenses.rps.mlflow`) is rebuilt from stored arrays and
its part models. The serving layer checks that the files are the ones saved (their
digests, :mod:`defenses.serving`); :func:`check_restored` checks that what they hold
is the state of *one* conformalized classifier for *these* parts, whoever wrote it:

* the classes: 1-D, sorted, distinct, at least two; every part model predicts
  labels among ``0..K-1`` (its ``classes_``, or a constant part's class, -1 for a
  part that abstains), and there
  are ``n_train_parts`` of them (one with ``prefit``);
* per confidence level :math:`1 - \alpha`, with :math:`k_c` = ``n_calib_parts``:
  the part sizes :math:`n_i \ge 1`, shape :math:`(k_c,)`; the ranks equal
  :func:`~defenses.rps.quantile.part_rank` of the sizes; :math:`\hat\tau` equals
  :func:`~defenses.rps.quantile.majority_threshold`; the guard equals
  :math:`\min_i n_i - n_{\min}`; the threshold bounds have shape
  :math:`(k_c, R + 1)` with :math:`R \le k_t`, are finite, each column sorted,
  :math:`\tau^{lo} \le \tau^{up}`, equal at radius 0, widening with the radius
  (:math:`\tau^{lo}` non-increasing, :math:`\tau^{up}` non-decreasing); the clean
  thresholds, sorted, are the radius-0 column.

Any violation raises ValueError naming the attribute and what was expected; no
number is ever answered from a state that fails (an edited threshold array of
another shape, a swapped part, another confidence level).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from defenses.rps.certificate import PartThresholds
from defenses.rps.quantile import majority_threshold, minimum_part_size, part_rank


def _fail(name: str, problem: str) -> ValueError:
    return ValueError(f"RPS state: {name} {problem}; the saved state is inconsistent")


def _check_classes(rps: Any, parts: list[Any]) -> int:
    classes = np.asarray(rps.classes_)
    if classes.ndim != 1 or classes.size < 2:
        raise _fail("classes_", f"has shape {classes.shape}, expected (K >= 2,)")
    if np.unique(classes).size != classes.size or np.any(
        np.argsort(classes, kind="stable") != np.arange(classes.size)
    ):
        raise _fail("classes_", "must be sorted and distinct")
    k = int(classes.size)
    settings = rps._settings()
    expected = 1 if settings.prefit else settings.k_t
    if len(parts) != expected:
        raise _fail("parts", f"number {len(parts)}, expected n_train_parts={expected}")
    for index, part in enumerate(parts):
        labels = getattr(part, "classes_", None)
        low = 0
        if labels is None and hasattr(part, "label"):
            labels, low = [part.label], -1  # a constant part; -1: abstains
        if labels is None:
            continue
        values = np.asarray(labels)
        if values.dtype.kind not in "iu" or values.min() < low or values.max() >= k:
            raise _fail(
                f"part {index}",
                f"predicts labels {values.tolist()[:6]}, expected among 0..{k - 1}",
            )
    return k


def _check_level(
    name: str,
    bounds: PartThresholds,
    sizes: np.ndarray[Any, Any],
    alpha: float,
    settings: Any,
) -> None:
    k_c = settings.k_c
    for key in ("lower", "upper"):
        array = np.asarray(getattr(bounds, key))
        if array.ndim != 2 or array.shape[0] != k_c:
            raise _fail(
                f"{name}.{key}",
                f"has shape {array.shape}, expected ({k_c}, R + 1) for "
                f"n_calib_parts={k_c}",
            )
        if not np.all(np.isfinite(array)):
            raise _fail(f"{name}.{key}", "holds NaN or inf")
        if np.any(np.diff(array, axis=0) < 0):
            raise _fail(f"{name}.{key}", "has a column that is not sorted")
    lower, upper = np.asarray(bounds.lower), np.asarray(bounds.upper)
    if lower.shape != upper.shape or lower.shape[1] - 1 > settings.k_t:
        raise _fail(
            name,
            f"bounds of shapes {lower.shape} and {upper.shape}, expected equal with "
            f"at most n_train_parts + 1 = {settings.k_t + 1} radii",
        )
    if np.any(lower > upper) or np.any(lower[:, 0] != upper[:, 0]):
        raise _fail(name, "has lower bounds above upper ones, or unequal at radius 0")
    if np.any(np.diff(lower, axis=1) > 0) or np.any(np.diff(upper, axis=1) < 0):
        raise _fail(name, "has bounds that narrow as the radius grows")
    tau = majority_threshold(k_c, alpha)
    if bounds.tau_hat != tau:
        raise _fail(f"{name}.tau_hat", f"is {bounds.tau_hat}, expected {tau}")
    guard = int(sizes.min()) - minimum_part_size(alpha, k_c, settings.quantile)
    if bounds.guard != guard:
        raise _fail(f"{name}.guard", f"is {bounds.guard}, expected {guard}")


def check_restored(rps: Any, parts: list[Any]) -> None:
    """Raise ValueError unless ``rps`` holds one consistent conformalized state.

    ``rps`` is a :class:`~defenses.rps.defense.ReliableConformalClassifier` whose
    fitted attributes were set from stored state, ``parts`` its part models (see
    the module for what is checked).
    """
    settings = rps._settings()
    _check_classes(rps, parts)
    sizes = np.asarray(rps.calib_part_sizes_)
    if sizes.shape != (settings.k_c,) or sizes.dtype.kind not in "iu":
        raise _fail(
            "calib_part_sizes_",
            f"has shape {sizes.shape} ({sizes.dtype}), expected integers of shape "
            f"({settings.k_c},) for n_calib_parts={settings.k_c}",
        )
    if sizes.min() < 1:
        raise _fail("calib_part_sizes_", "holds an empty part")
    levels = tuple(rps.level_thresholds_)
    if len(levels) != len(settings.alphas):
        raise _fail(
            "level_thresholds_",
            f"holds {len(levels)} levels, expected {len(settings.alphas)}",
        )
    ranks = np.asarray(rps.ranks_).reshape(len(levels), -1)
    thresholds = np.asarray(rps.thresholds_, dtype=np.float64).reshape(len(levels), -1)
    for index, (alpha, bounds) in enumerate(zip(settings.alphas, levels, strict=True)):
        name = f"level_thresholds_[{index}] (confidence_level={1 - alpha:.6g})"
        if not isinstance(bounds, PartThresholds):
            raise _fail(name, f"is a {type(bounds).__name__}, expected PartThresholds")
        _check_level(name, bounds, sizes, alpha, settings)
        expected = [
            part_rank(int(n), alpha, settings.k_c, settings.quantile) for n in sizes
        ]
        if ranks.shape[1] != settings.k_c or ranks[index].tolist() != expected:
            raise _fail("ranks_", f"are {ranks[index].tolist()}, expected {expected}")
        if thresholds.shape[1] != settings.k_c or not np.array_equal(
            np.sort(thresholds[index]), np.asarray(bounds.lower)[:, 0]
        ):
            raise _fail(
                "thresholds_",
                f"of shape {np.asarray(rps.thresholds_).shape} differ from the "
                f"threshold bounds at radius 0 of {name}",
            )
    for name, field in (("tau_hat_", "tau_hat"), ("guard_", "guard")):
        stored = np.atleast_1d(np.asarray(getattr(rps, name))).tolist()
        expected = [getattr(b, field) for b in levels]
        if stored != expected:
            raise _fail(name, f"is {stored}, expected {expected} (the levels')")
    if rps.part_thresholds_ is not levels[0] and not (
        np.array_equal(rps.part_thresholds_.lower, levels[0].lower)
        and np.array_equal(rps.part_thresholds_.upper, levels[0].upper)
    ):
        raise _fail("part_thresholds_", "differ from level_thresholds_[0]")
