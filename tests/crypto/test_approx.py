from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from defense_suite.crypto.he.approx import (
    RangeError,
    RangeGuard,
    chebyshev_fit,
    depth_of,
    gaussian_kernel_poly,
    inverse_sqrt_poly,
    max_error,
    polyval,
    tanh_poly,
)


@pytest.mark.parametrize(
    ("degree", "depth"), [(1, 1), (2, 2), (3, 2), (4, 3), (7, 3), (8, 4)]
)
def test_polyval_depth_matches_tenseal(degree: int, depth: int) -> None:
    # measured on TenSEAL 0.3.18 (levels consumed by CKKSVector.polyval)
    assert depth_of(degree) == depth


def test_gaussian_kernel_fit_golden() -> None:
    # Chebyshev degree 7 of exp(-2u) on [0, 1]: error ~8e-8 (measured)
    p = gaussian_kernel_poly(2.0)
    assert max_error(lambda u: np.exp(-2.0 * u), p.coefficients, 0.0, 1.0) < 1e-6
    assert p.depth == 3


def test_inverse_sqrt_with_newton_converges() -> None:
    p = inverse_sqrt_poly(0.1)
    s = np.linspace(0.1, 1.0, 500)
    y = polyval(p.coefficients, s)
    errors = []
    for _ in range(3):
        errors.append(np.max(np.abs(y * np.sqrt(s) - 1)))
        y = y * (3 - s * y * y) / 2
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-4


def test_tanh_poly_is_odd() -> None:
    p = tanh_poly(2.0)
    assert np.allclose(p.coefficients[::2], 0.0, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=6))
def test_fit_reproduces_polynomials(coefficients: list[float]) -> None:
    c = np.array(coefficients)
    fitted = chebyshev_fit(lambda x: polyval(c, x), -1.0, 1.0, max(len(c) - 1, 1))
    grid = np.linspace(-1, 1, 50)
    assert np.allclose(polyval(fitted, grid), polyval(c, grid), atol=1e-8)


def test_range_guard() -> None:
    guard = RangeGuard("u", 0.0, 1.0)
    guard(np.array([0.0, 0.5, 1.0]))
    with pytest.raises(RangeError, match="outside the calibrated range"):
        guard(np.array([0.5, 1.2]))
    with pytest.raises(RangeError, match="NaN"):
        guard(np.array([np.nan]))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: chebyshev_fit(np.exp, 1.0, 0.0, 3), "lo < hi"),
        (lambda: chebyshev_fit(np.exp, 0.0, 1.0, 0), "degree"),
        (lambda: gaussian_kernel_poly(-1.0), "bound"),
        (lambda: inverse_sqrt_poly(0.0), "lo"),
        (lambda: RangeGuard("x", 1.0, 1.0), "lo < hi"),
        (lambda: depth_of(0), "degree"),
    ],
)
def test_bad_inputs(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
