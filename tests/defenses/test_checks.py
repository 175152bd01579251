"""The shared argument checks: accepted values, refused values, and their messages."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

from defenses import checks
from defenses.checks import check_choice, check_fraction, check_int, check_real


def test_docstring_examples() -> None:
    assert doctest.testmod(checks).failed == 0


@pytest.mark.parametrize("value", [3, np.int64(3), np.uint8(3)])
def test_check_int_accepts_integers(value: object) -> None:
    result = check_int("A.n", value, minimum=1, maximum=5)
    assert result == 3
    assert type(result) is int


@pytest.mark.parametrize(
    ("value", "minimum", "maximum", "message"),
    [
        (True, 0, None, "A.n must be an int >= 0, got True"),
        (2.0, 0, None, "A.n must be an int >= 0, got 2.0"),
        ("2", None, None, "A.n must be an int, got '2'"),
        (0, 1, None, "A.n must be an int >= 1, got 0"),
        (6, None, 5, "A.n must be an int <= 5, got 6"),
        (6, 1, 5, "A.n must be an int in [1, 5], got 6"),
    ],
)
def test_check_int_refuses(
    value: object, minimum: int | None, maximum: int | None, message: str
) -> None:
    with pytest.raises(ValueError, match="must be an int") as error:
        check_int("A.n", value, minimum, maximum)
    assert str(error.value) == message


def test_check_real_endpoints() -> None:
    assert check_real("A.x", 0, 0.0, 1.0) == 0.0
    assert check_real("A.x", np.float32(1.0), 0.0, 1.0) == 1.0
    for value in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"in \(0.0, 1.0\)"):
            check_real("A.x", value, 0.0, 1.0, open_low=True, open_high=True)
    with pytest.raises(ValueError, match=r"A.x must be a finite number > 0.0"):
        check_real("A.x", 0.0, 0.0, open_low=True)
    with pytest.raises(ValueError, match=r"<= 2.0"):
        check_real("A.x", 2.5, high=2.0)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "0.5", None])
def test_check_real_refuses_non_finite_and_non_numbers(value: object) -> None:
    with pytest.raises(ValueError, match=r"A\.x must be a finite number"):
        check_real("A.x", value)


@pytest.mark.parametrize("value", [1e-12, 0.5, np.float32(0.25), 1 - 1e-12])
def test_check_fraction_accepts_the_open_unit_interval(value: object) -> None:
    assert check_fraction("A.share", value) == float(value)


@pytest.mark.parametrize("value", [0, 0.0, 1, 1.0, -0.1, 1.5, math.nan, True, "0.5"])
def test_check_fraction_refuses_the_endpoints_and_the_rest(value: object) -> None:
    with pytest.raises(ValueError, match=r"A\.share must be a finite number in \(0"):
        check_fraction("A.share", value)


def test_check_choice() -> None:
    assert check_choice("A.mode", "exact", ("exact", "official")) == "exact"
    with pytest.raises(ValueError, match=r"one of \('a', 'b'\), got 'c'"):
        check_choice("A.mode", "c", ["a", "b"])


def test_check_finite_module_names_the_first_broken_tensor() -> None:
    import torch
    from torch import nn

    from defenses.checks import check_finite_module

    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    check_finite_module("model", model)  # finite: no error
    model[1].running_mean[0] = math.inf
    with pytest.raises(ValueError, match=r"model: buffer '1\.running_mean' holds 1"):
        check_finite_module("model", model)
    model[1].running_mean[0] = 0.0
    with torch.no_grad():
        model[0].bias[1] = math.nan
    with pytest.raises(ValueError, match=r"parameter '0\.bias' holds 1 NaN"):
        check_finite_module("model", model)
