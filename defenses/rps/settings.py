r"""The parameters of :class:`~defenses.rps.defense.ReliableConformalClassifier`.

The estimator stores its parameters as given (scikit-learn's contract: ``clone``
and ``set_params`` must work on any value) and validates them here when it uses
them, in :meth:`fit` and :meth:`conformalize`; every message names the parameter.
Numpy integers and reals are accepted wherever Python ones are; a positive
``n_jobs`` above the number of cores is capped there (the result does not depend
on ``n_jobs``).
The miscoverage level is :math:`\alpha = 1 - \text{confidence\_level}`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from defenses.checks import check_choice, check_int, check_real
from defenses.rps.quantile import QUANTILE_MODES, QuantileMode


@dataclass(frozen=True)
class Settings:
    r"""Validated parameters (``k_t``, ``k_c``, :math:`\alpha`, ...)."""

    k_t: int
    k_c: int
    alpha: float
    quantile: QuantileMode
    softmax: bool
    random_state: int
    n_jobs: int | None


def check_settings(params: Mapping[str, Any]) -> Settings:
    """Validate the estimator's ``get_params(deep=False)``, or raise naming one.

    Raises
    ------
    ValueError
        A parameter out of range (``n_jobs=0``, ``confidence_level=1``, ...).
    TypeError
        ``softmax`` that is not a bool.
    """
    confidence = check_real(
        "confidence_level",
        params["confidence_level"],
        0.0,
        1.0,
        open_low=True,
        open_high=True,
    )
    softmax = params["softmax"]
    if not isinstance(softmax, bool | np.bool_):
        raise TypeError(f"softmax must be a bool, got {softmax!r}")
    n_jobs = params["n_jobs"]
    if n_jobs is not None and check_int("n_jobs", n_jobs) == 0:
        raise ValueError("n_jobs must be None or a nonzero int (-1: all cores), got 0")
    if n_jobs is not None and n_jobs > 0:
        n_jobs = min(int(n_jobs), os.cpu_count() or 1)
    quantile = check_choice("quantile", params["quantile"], QUANTILE_MODES)
    return Settings(
        k_t=check_int("n_train_parts", params["n_train_parts"], 1),
        k_c=check_int("n_calib_parts", params["n_calib_parts"], 1),
        alpha=1.0 - confidence,
        quantile=cast(QuantileMode, quantile),
        softmax=bool(softmax),
        random_state=check_int("random_state", params["random_state"], 0, 2**32 - 1),
        n_jobs=None if n_jobs is None else int(n_jobs),
    )
