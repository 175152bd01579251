r"""Intervals of a projection from the errors a model makes at held-out widths.

A cost model fitted on small widths and checked on wider held-out ones leaves a
signed relative error :math:`e = \hat x / x - 1` per arm and width; :func:`interval`
turns them into a range of the error at a far width (the paper's), and
:func:`bounds` into the range of the true value given the prediction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def interval(
    errors: Mapping[int, Sequence[float]], target: float
) -> tuple[float, float]:
    r"""The range of a signed relative error at width ``target``, from held-out widths.

    ``errors[d]`` are the signed relative errors :math:`e = \hat x / x - 1` of a
    quantity (one per arm or shape) measured at held-out width ``d``. The range is
    :math:`[-E, E]` with :math:`E` the largest :math:`|e|` over every one of them
    and, with two or more held-out widths, over the straight lines of each width's
    least and largest error in :math:`\log_2 d` evaluated at ``target`` (an error
    that grows with the width is carried on to the projection, not dropped). It is
    symmetric: one held-out error's sign is no correction to trust, only its size.
    The true value lies in :math:`[\hat x / (1 + E), \hat x / (1 - E)]` if the error
    at ``target`` stays within :math:`E`; that is the assumption, the held-out
    widths are its evidence.

    Raises
    ------
    ValueError
        If there is no error, one is not finite, or ``target`` is not positive.
    """
    values = [e for es in errors.values() for e in es]
    if not values or not all(math.isfinite(e) for e in values):
        raise ValueError(f"interval: needs finite errors, got {dict(errors)}")
    if not (math.isfinite(target) and target > 0):
        raise ValueError(f"interval: target must be a positive width, got {target!r}")
    lo, hi = min(values), max(values)
    widths = sorted(d for d, es in errors.items() if es)
    if len(widths) >= 2:
        x = np.log2(np.asarray(widths, dtype=np.float64))
        for pick in (min, max):
            y = np.array([pick(errors[d]) for d in widths])
            slope, intercept = np.polyfit(x, y, 1)
            at = float(slope * math.log2(target) + intercept)
            lo, hi = min(lo, at), max(hi, at)
    size = max(abs(lo), abs(hi))
    return -size, size


def bounds(value: float, errors: tuple[float, float]) -> tuple[float, float]:
    """``value / (1 + e)`` over the error range; inf where the range reaches -1."""
    lo, hi = errors
    low = value / (1.0 + hi)
    high = value / (1.0 + lo) if lo > -1.0 else math.inf
    return low, high
