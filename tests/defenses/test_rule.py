"""The bad-input rule helper and its strategies catch what they must."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given

from defenses.testing import (
    VALID_NUMPY_SCALARS,
    assert_rule,
    bad_arrays,
    bad_reals,
    probability_rows,
    rule_settings,
)


def test_refusal_naming_the_parameter_passes():
    def call():
        raise ValueError("temperature must be > 0, got -1")

    assert assert_rule(call, ["temperature"]) is None


def test_refusal_naming_nothing_fails():
    def call():
        raise ValueError("need at least one array to concatenate")

    with pytest.raises(AssertionError, match="names none of"):
        assert_rule(call, ["x"])


def test_other_exception_fails():
    def call():
        raise IndexError("index 3 is out of bounds")

    with pytest.raises(AssertionError, match="IndexError"):
        assert_rule(call, ["n_calib_parts"])


@pytest.mark.parametrize(
    "value",
    [
        np.array([1.0, math.nan]),
        torch.tensor([math.inf]),
        {"probs": (np.zeros(2), float("nan"))},
        [1.0, -math.inf],
    ],
    ids=["array", "tensor", "nested", "list"],
)
def test_non_finite_results_fail(value):
    with pytest.raises(AssertionError, match=r"not finite|NaN or inf"):
        assert_rule(lambda: value, ["x"])


def test_valid_result_is_returned_and_checked():
    out = assert_rule(lambda: np.ones(3) / 3, ["x"])
    assert out is not None
    np.testing.assert_allclose(out.sum(), 1.0)

    def must_sum_to_two(result):
        assert result.sum() == pytest.approx(2.0)

    with pytest.raises(AssertionError):
        assert_rule(lambda: np.ones(3) / 3, ["x"], valid=must_sum_to_two)


def test_params_must_be_a_sequence_of_names():
    with pytest.raises(TypeError, match="params"):
        assert_rule(lambda: 1, "x")


def test_numpy_scalars_are_numbers():
    assert all(isinstance(v, np.generic) for v in VALID_NUMPY_SCALARS)


@rule_settings(30)
@given(x=bad_arrays((4, 3)))
def test_bad_arrays_stay_near_the_shape(x):
    assert isinstance(x, np.ndarray)
    assert x.ndim in (1, 2, 3)
    assert x.size <= 4 * 4 * 1 or x.shape == (4, 3, 1)


@rule_settings(40)
@given(p=probability_rows(5, 4))
def test_probability_rows_are_valid_or_broken_one_way(p):
    assert isinstance(p, np.ndarray)
    if p.shape == (5, 4) and np.isfinite(p).all() and (p >= 0).all():
        sums = p.astype(np.float64).sum(axis=1)
        assert np.allclose(sums, 1.0, atol=5e-3) or not np.allclose(sums, 1.0)


@rule_settings(30)
@given(v=bad_reals())
def test_bad_reals_draw_numbers_and_wrong_types(v):
    assert v is None or isinstance(
        v, (int, float, complex, str, bytes, list, np.generic)
    )
