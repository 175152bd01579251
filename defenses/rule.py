"""The bad-input rule, and the hypothesis strategies that test it by property.

Every public entry point either returns a valid result or raises ``ValueError`` /
``TypeError`` naming the parameter at fault. Package tests drive their entry points
with :func:`bad_reals`, :func:`bad_arrays` and :func:`probability_rows` and assert
the rule with :func:`assert_rule`; hypothesis is imported only when a strategy or
:func:`rule_settings` is built, so the library never needs it. Re-exported by
:mod:`defenses.testing`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

SLOW_ENV = "DEFENSE_SUITE_SLOW_TESTS"
"""Set to ``1`` by the test suite's ``--runslow``: :func:`rule_settings` then runs
ten times as many examples."""

EXTREME_REALS: tuple[object, ...] = (
    math.nan,
    math.inf,
    -math.inf,
    1e39,
    -1e39,
    1e308,
    1e-320,
    -1e-320,
    0.0,
    -0.0,
    -1.0,
    np.float64(math.nan),
    np.float32(math.inf),
    np.float16(65504.0),
)
"""Reals that break naive code: non-finite, float32 overflow, subnormal, signs."""

WRONG_TYPES: tuple[object, ...] = (True, False, 1 + 2j, "1", None, [1.0], b"1")
"""Values of the wrong type for a number (bools count: ``True`` is not a count)."""

VALID_NUMPY_SCALARS: tuple[object, ...] = (
    np.int8(1),
    np.int32(2),
    np.int64(3),
    np.uint16(4),
    np.float16(0.5),
    np.float32(0.25),
    np.float64(0.75),
)
"""Numpy scalars a user passes where a Python number is accepted; never refused."""


def assert_rule(
    call: Callable[[], T],
    params: Sequence[str],
    valid: Callable[[T], object] | None = None,
) -> T | None:
    """Assert the bad-input rule on one call of a public entry point.

    Either ``call()`` returns a value whose every array, tensor and number is finite
    and which passes ``valid`` (a function that asserts), or it raises ``ValueError``
    or ``TypeError`` whose message names one of ``params`` (case-insensitive). Any
    other exception is a breach: the error came from deep inside a library and names
    nothing the user passed.

    Parameters
    ----------
    call : callable
        The entry point with its (generated) arguments bound, e.g.
        ``lambda: shield(probs)``.
    params : sequence of str
        The names a refusal may cite: the parameter names as the user wrote them.
    valid : callable, optional
        Further checks on a returned value (shape, simplex, labels from ``classes_``).

    Returns
    -------
    The returned value, or None when the call refused.
    """
    if isinstance(params, str) or not params:
        raise TypeError("params must be a non-empty sequence of parameter names")
    try:
        result = call()
    except (ValueError, TypeError) as error:
        message = str(error).lower()
        if not any(name.lower() in message for name in params):
            raise AssertionError(
                f"{type(error).__name__} names none of {list(params)}: {error}"
            ) from error
        return None
    except Exception as error:
        raise AssertionError(
            "expected a valid result or a ValueError/TypeError naming one of "
            f"{list(params)}, got {type(error).__name__}: {error}"
        ) from error
    _assert_finite(result, "result")
    if valid is not None:
        valid(result)
    return result


def _assert_finite(value: object, where: str, depth: int = 0) -> None:
    """Raise AssertionError if any number reachable from ``value`` is NaN or inf."""
    if depth > 4:
        return
    if isinstance(value, bool | int | np.integer | str | bytes) or value is None:
        return
    if isinstance(value, float | complex | np.floating | np.complexfloating):
        if not np.isfinite(value):
            raise AssertionError(f"{where} is not finite: {value!r}")
        return
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "fc" and value.size and not np.isfinite(value).all():
            raise AssertionError(f"{where} holds NaN or inf values")
        return
    module = type(value).__module__
    if module.startswith("torch") and hasattr(value, "is_floating_point"):
        import torch

        tensor = value.detach() if isinstance(value, torch.Tensor) else None
        if (
            tensor is not None
            and tensor.is_floating_point()
            and tensor.numel()
            and not bool(torch.isfinite(tensor).all())
        ):
            raise AssertionError(f"{where} holds NaN or inf values")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            _assert_finite(item, f"{where}[{key!r}]", depth + 1)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _assert_finite(item, f"{where}[{index}]", depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _assert_finite(
                getattr(value, field.name), f"{where}.{field.name}", depth + 1
            )


def rule_settings(max_examples: int = 20) -> Any:
    """Hypothesis settings for a bad-input test: few examples, ten times more slow.

    No deadline (the first example may compile kernels); the examples grow tenfold
    when the suite runs with ``--runslow`` (it sets :data:`SLOW_ENV`).
    """
    from hypothesis import HealthCheck, settings

    factor = 10 if os.environ.get(SLOW_ENV) == "1" else 1
    return settings(
        max_examples=max_examples * factor,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


def bad_reals() -> Any:
    """Hypothesis strategy: numbers a user might pass where a real is expected.

    A mix of ordinary floats, the extreme values of :data:`EXTREME_REALS`, values of
    the wrong type (:data:`WRONG_TYPES`) and valid numpy scalars
    (:data:`VALID_NUMPY_SCALARS`), which must be accepted wherever Python numbers are.
    """
    from hypothesis import strategies as st

    return st.one_of(
        st.sampled_from(EXTREME_REALS),
        st.sampled_from(WRONG_TYPES),
        st.sampled_from(VALID_NUMPY_SCALARS),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(2**70), max_value=2**70),
    )


DTYPES = (
    np.float64,
    np.float64,
    np.float32,
    np.float16,
    np.int64,
    np.bool_,
    np.complex128,
)
BREAKAGES = (
    "valid",
    "valid",
    "valid",
    "scaled",
    "negative",
    "nan",
    "inf",
    "columns",
    "empty",
)


def bad_arrays(shape: tuple[int, ...]) -> Any:
    """Hypothesis strategy: arrays near ``shape``, with the entries that break code.

    Draws the shape itself or a neighbour of it (no rows, one row, a missing or an
    extra axis, a column more or less), a dtype among float16/32/64, int64, bool and
    complex128, and entries that may be NaN, inf, huge (float32 overflow) or
    subnormal.
    """
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp

    @st.composite
    def build(draw: Any) -> np.ndarray:
        target = draw(st.sampled_from(_neighbour_shapes(shape)))
        dtype = draw(st.sampled_from(DTYPES))
        kind = np.dtype(dtype).kind
        elements: Any
        if kind == "f":
            width: Any = np.finfo(dtype).bits
            elements = st.one_of(
                st.floats(-10, 10, width=width),
                st.sampled_from([math.nan, math.inf, -math.inf]),
                st.floats(allow_nan=True, allow_infinity=True, width=width),
            )
        elif kind == "c":
            elements = st.complex_numbers(max_magnitude=10)
        elif kind == "b":
            elements = st.booleans()
        else:
            elements = st.integers(-(2**40), 2**40)
        array: np.ndarray = draw(hnp.arrays(dtype, target, elements=elements))
        return array

    return build()


def probability_rows(n: int, k: int) -> Any:
    """Hypothesis strategy: ``(n, k)`` rows of class probabilities, valid or broken.

    Half are on the simplex (Dirichlet rows, possibly with exact zeros, in float64,
    float32 or float16); the others are broken one way: a row scaled off the simplex,
    a negative entry, a NaN or inf, a wrong number of columns, or no rows at all.
    """
    from hypothesis import strategies as st

    @st.composite
    def build(draw: Any) -> np.ndarray:
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        alpha = draw(st.sampled_from([0.05, 0.5, 5.0]))
        rows = rng.dirichlet(np.full(k, alpha), size=n) if k >= 1 else np.ones((n, 0))
        dtype = draw(st.sampled_from([np.float64, np.float32, np.float16]))
        rows = rows.astype(dtype)
        if dtype is not np.float64:
            rows = (rows / rows.sum(axis=1, keepdims=True)).astype(dtype)
        broken = draw(st.sampled_from(BREAKAGES))
        if broken == "valid" or n == 0 or k == 0:
            return rows
        out = rows.astype(np.float64)
        i, j = int(rng.integers(n)), int(rng.integers(k))
        if broken == "scaled":
            out[i] *= 1.5
        elif broken == "negative":
            out[i, j] = -0.25
        elif broken == "nan":
            out[i, j] = math.nan
        elif broken == "inf":
            out[i, j] = math.inf
        elif broken == "columns":
            out = np.hstack([out, np.zeros((n, 1))])
        else:
            out = out[:0]
        return out

    return build()


def _neighbour_shapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``shape`` and the shapes next to it that entry points must refuse or handle."""
    shapes = [shape, shape]
    if shape:
        shapes += [(0, *shape[1:]), (1, *shape[1:]), shape[1:] or (1,)]
        shapes.append((*shape, 1))
    if len(shape) >= 2:
        shapes += [(*shape[:-1], shape[-1] + 1), (*shape[:-1], max(shape[-1] - 1, 0))]
    return shapes
