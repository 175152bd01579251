"""Argument checks shared by the packages' configuration objects.

Every scenario, attack and defense validates its parameters when it is built, so a
bad spec fails at once with a message naming the field, instead of deep inside a
run. The checks here cover what the dataclasses need: integers in a range (a
``bool`` is refused, though Python counts it as an ``int``), finite real numbers in
an interval (fractions: the open interval (0, 1)), one choice out of a fixed set,
and no unknown keys in a benchmark's parameters; ``int_param`` reads a benchmark's
positive integer parameter.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

T = TypeVar("T")


def check_int(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Return ``value`` as an ``int``, or raise ValueError naming ``name``.

    Parameters
    ----------
    name : str
        The field as the user wrote it (e.g. ``"CanaryDeletion.pool"``).
    value : object
        The value to check: an ``int`` or numpy integer, not a ``bool``.
    minimum, maximum : int or None
        Inclusive bounds (None: unbounded).

    Examples
    --------
    >>> check_int("Spec.seeds", 3, minimum=1)
    3
    >>> check_int("Spec.seeds", True, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: Spec.seeds must be an int >= 1, got True
    """
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
    number = int(value) if ok else 0  # type: ignore[call-overload]
    if (
        not ok
        or (minimum is not None and number < minimum)
        or (maximum is not None and number > maximum)
    ):
        raise ValueError(
            f"{name} must be an int{_interval(minimum, maximum, '[', ']')}, "
            f"got {value!r}"
        )
    return number


def check_real(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
) -> float:
    """Return ``value`` as a finite ``float`` in the interval, or raise ValueError.

    ``low`` and ``high`` bound the interval (None: unbounded); ``open_low`` and
    ``open_high`` exclude the endpoint.

    Examples
    --------
    >>> check_real("Game.fraction", 0.5, 0.0, 1.0, open_low=True, open_high=True)
    0.5
    >>> check_real("Game.fraction", 1.0, 0.0, 1.0, open_low=True, open_high=True)
    Traceback (most recent call last):
    ...
    ValueError: Game.fraction must be a finite number in (0.0, 1.0), got 1.0
    """
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool
    )
    number = float(value) if ok else math.nan  # type: ignore[arg-type]
    inside = math.isfinite(number)
    if inside and low is not None:
        inside = number > low if open_low else number >= low
    if inside and high is not None:
        inside = number < high if open_high else number <= high
    if not inside:
        opening, closing = "(" if open_low else "[", ")" if open_high else "]"
        bounds = _interval(low, high, opening, closing)
        raise ValueError(f"{name} must be a finite number{bounds}, got {value!r}")
    return number


def check_fraction(name: str, value: object) -> float:
    """Return ``value`` as a ``float`` strictly between 0 and 1, or raise ValueError.

    The check of every share, rate and confidence level: :func:`check_real` on the
    open interval (0, 1).

    Examples
    --------
    >>> check_fraction("Split.confidence", 0.95)
    0.95
    >>> check_fraction("Split.confidence", 1)
    Traceback (most recent call last):
    ...
    ValueError: Split.confidence must be a finite number in (0.0, 1.0), got 1
    """
    return check_real(name, value, 0.0, 1.0, open_low=True, open_high=True)


def check_choice(name: str, value: T, choices: Collection[T]) -> T:
    """Return ``value`` if it is one of ``choices``, or raise ValueError listing them.

    Examples
    --------
    >>> check_choice("Game.dataset", "iris", ("digits", "wine"))
    Traceback (most recent call last):
    ...
    ValueError: Game.dataset must be one of ('digits', 'wine'), got 'iris'
    """
    if value not in choices:
        listed = tuple(choices) if not isinstance(choices, tuple) else choices
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value


def as_numbers(
    what: str,
    value: Any,
    dtype: npt.DTypeLike = np.float64,
    error: type[Exception] = ValueError,
) -> npt.NDArray[Any]:
    """``value`` as a numpy array of ``dtype``, or raise ``error`` naming ``what``.

    For values numpy cannot cast (strings, ragged lists, arbitrary objects): the
    message keeps numpy's reason. Shapes and finiteness are the caller's to check.

    Examples
    --------
    >>> as_numbers("slice_prior", ["a", 1])
    Traceback (most recent call last):
    ...
    ValueError: slice_prior must be numbers: could not convert string to float: 'a'
    """
    try:
        return np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as reason:
        raise error(f"{what} must be numbers: {reason}") from reason


def check_keys(owner: str, params: Collection[str], accepted: Collection[str]) -> None:
    """Raise ValueError naming every key of ``params`` not in ``accepted``.

    Examples
    --------
    >>> check_keys("ssd-perf", {"K": 10, "rows": 5}, {"K", "N"})
    Traceback (most recent call last):
    ...
    ValueError: ssd-perf: unknown parameter(s) ['rows']; accepted: ['K', 'N']
    """
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"{owner}: unknown parameter(s) {unknown}; accepted: {sorted(accepted)}"
        )


def check_indices(what: str, values: npt.NDArray[Any], bound: int) -> None:
    """Raise ValueError unless every entry of the non-empty ``values`` is in [0, bound).

    For arrays of class labels or token ids; ``what`` is the message's subject.

    Examples
    --------
    >>> check_indices("labels", np.array([0, 3]), 3)
    Traceback (most recent call last):
    ...
    ValueError: labels must lie in [0, 3), got [0, 3]
    """
    low, high = values.min(), values.max()
    if low < 0 or high >= bound:
        raise ValueError(f"{what} must lie in [0, {bound}), got [{low}, {high}]")


def check_finite_module(owner: str, module: Any) -> None:
    """Raise ValueError naming the first parameter or buffer of ``module`` with NaN/inf.

    ``module`` is a ``torch.nn.Module`` (torch is imported only here); integer and
    boolean buffers (e.g. BatchNorm's ``num_batches_tracked``) are skipped. A model
    whose weights hold NaN computes NaN, so it is refused before it gets a number.

    Parameters
    ----------
    owner : str
        How the message names the module (e.g. ``"model"``).
    module : torch.nn.Module
        The module to check.
    """
    import torch

    for kind, items in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for name, tensor in items:
            if not (tensor.is_floating_point() or tensor.is_complex()):
                continue
            bad = int((~torch.isfinite(tensor.detach())).sum())
            if bad:
                raise ValueError(
                    f"{owner}: {kind} {name!r} holds {bad} NaN or inf value(s) (of "
                    f"{tensor.numel()}); a broken model is refused"
                )


def _interval(low: float | None, high: float | None, opening: str, closing: str) -> str:
    """`` in [a, b]``, `` >= a``, `` <= b`` or nothing, for the messages."""
    if low is not None and high is not None:
        return f" in {opening}{low}, {high}{closing}"
    if low is not None:
        return f" {'>' if opening == '(' else '>='} {low}"
    if high is not None:
        return f" {'<' if closing == ')' else '<='} {high}"
    return ""


def int_param(params: Mapping[str, Any], key: str, default: int) -> int:
    """The positive integer benchmark parameter ``key`` (``default`` when absent).

    Examples
    --------
    >>> int_param({"rank": 4}, "rank", 2), int_param({}, "rank", 2)
    (4, 2)
    >>> int_param({"rank": 0}, "rank", 2)
    Traceback (most recent call last):
    ...
    ValueError: benchmark parameter 'rank' must be an int >= 1, got 0
    """
    return check_int(f"benchmark parameter {key!r}", params.get(key, default), 1)
