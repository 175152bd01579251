r"""The parameters of :class:`~defenses.rps.defense.ReliableConformalClassifier`.

The estimator stores its parameters as given (scikit-learn's contract: ``clone``
and ``set_params`` must work on any value) and validates them here when it uses
them, in :meth:`fit` and :meth:`conformalize`; every message names the parameter.
Numpy integers and reals are accepted wherever Python ones are; a positive
``n_jobs`` above the number of cores is capped there (the result does not depend
on ``n_jobs``).
The miscoverage level is :math:`\alpha = 1 - \text{confidence\_level}`; as in MAPIE
1.x, ``confidence_level`` may be a list (one set per level, in the given order).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from defenses.checks import check_choice, check_int, check_real
from defenses.rps.conformity import (
    ConformityScore,
    check_conformity_score,
    check_prefit,
)
from defenses.rps.quantile import QUANTILE_MODES, QuantileMode


@dataclass(frozen=True)
class Settings:
    r"""Validated parameters (``k_t``, ``k_c``, :math:`\alpha`, ...)."""

    k_t: int
    k_c: int
    alphas: tuple[float, ...]
    several: bool
    quantile: QuantileMode
    softmax: bool
    random_state: int
    n_jobs: int | None
    conformity_score: ConformityScore = "lac"
    prefit: bool = False

    @property
    def alpha(self) -> float:
        """The (first) miscoverage level."""
        return self.alphas[0]


def confidence_levels(value: Any) -> tuple[tuple[float, ...], bool]:
    """The confidence levels (each in (0, 1)) and whether a list was given.

    Raises
    ------
    ValueError
        An empty list, or a level out of range (named ``confidence_level[i]``).
    """
    scalar = isinstance(value, str | bytes) or not isinstance(value, Iterable)
    if scalar or (isinstance(value, np.ndarray) and value.ndim == 0):
        level = check_real(
            "confidence_level", value, 0.0, 1.0, open_low=True, open_high=True
        )
        return (level,), False
    levels = tuple(value)
    if not levels:
        raise ValueError(
            "confidence_level must be a float or a non-empty list of floats in (0, "
            f"1), got {value!r}"
        )
    return tuple(
        check_real(f"confidence_level[{i}]", v, 0.0, 1.0, open_low=True, open_high=True)
        for i, v in enumerate(levels)
    ), True


_NAMES: dict[type, tuple[str, ...]] = {}


def shallow_params(estimator: Any) -> dict[str, Any]:
    """``estimator.get_params(deep=False)``, the names read once per class.

    scikit-learn inspects the constructor's signature on every call (~30 us).
    """
    kind = type(estimator)
    if kind not in _NAMES:
        _NAMES[kind] = tuple(kind._get_param_names())
    return {name: getattr(estimator, name) for name in _NAMES[kind]}


def check_settings(params: Mapping[str, Any]) -> Settings:
    """Validate the estimator's ``get_params(deep=False)``, or raise naming one.

    Raises
    ------
    ValueError
        A parameter out of range (``n_jobs=0``, ``confidence_level=1``, ...).
    TypeError
        ``softmax`` or ``prefit`` that is not a bool.
    """
    levels, several = confidence_levels(params["confidence_level"])
    softmax = params["softmax"]
    if not isinstance(softmax, bool | np.bool_):
        raise TypeError(f"softmax must be a bool, got {softmax!r}")
    n_jobs = params["n_jobs"]
    if n_jobs is not None and check_int("n_jobs", n_jobs) == 0:
        raise ValueError("n_jobs must be None or a nonzero int (-1: all cores), got 0")
    if n_jobs is not None and n_jobs > 0:
        n_jobs = min(int(n_jobs), os.cpu_count() or 1)
    quantile = check_choice("quantile", params["quantile"], QUANTILE_MODES)
    prefit = check_prefit(params.get("prefit", False))
    k_t = check_int("n_train_parts", params["n_train_parts"], 1)
    if prefit and k_t != 1:
        raise ValueError(
            f"prefit=True wraps one fitted estimator, one training part, so "
            f"n_train_parts must be 1, got {k_t}: to certify training poisoning, "
            "use prefit=False and fit (or from_voter for parts trained elsewhere)"
        )
    return Settings(
        k_t=k_t,
        k_c=check_int("n_calib_parts", params["n_calib_parts"], 1),
        alphas=tuple(1.0 - level for level in levels),
        several=several,
        quantile=cast(QuantileMode, quantile),
        softmax=bool(softmax),
        random_state=check_int("random_state", params["random_state"], 0, 2**32 - 1),
        n_jobs=None if n_jobs is None else int(n_jobs),
        conformity_score=check_conformity_score(params.get("conformity_score", "lac")),
        prefit=prefit,
    )
