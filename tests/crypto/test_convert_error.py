"""The measured encrypted logit error table and the margin check built on it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from defense_suite.crypto.conversion import error
from defense_suite.crypto.conversion.error import (
    MEASURED,
    expected_logit_error,
    uncertain,
)
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture


def test_the_table_covers_the_measured_grid() -> None:
    for depth in (1, 2, 3):
        for width in (8, 16):
            value = MEASURED[depth, width]
            assert 0 < value < 1, (depth, width, value)
            assert expected_logit_error(depth, width) >= value


def test_lookup_is_conservative_and_monotone(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {(1, 8): 1e-3, (1, 16): 5e-4, (2, 8): 2e-3, (2, 16): 4e-3}
    monkeypatch.setattr(error, "MEASURED", table)
    assert expected_logit_error(1, 8) == 1e-3
    assert expected_logit_error(1, 16) == 1e-3  # never below a smaller size's
    assert expected_logit_error(1, 4) == 1e-3  # below the grid: the smallest
    assert expected_logit_error(2, 12) == 4e-3  # between widths: the next one up
    assert math.isinf(expected_logit_error(3, 8))  # beyond: not measured
    assert math.isinf(expected_logit_error(1, 32))
    values = [[expected_logit_error(d, w) for w in (4, 8, 12, 16)] for d in (1, 2)]
    assert np.all(np.diff(values, axis=0) >= 0)
    assert np.all(np.diff(values, axis=1) >= 0)
    with pytest.raises(ValueError, match="depth"):
        expected_logit_error(0, 8)


def test_uncertain_flags_margins_below_twice_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(error, "MEASURED", {(2, 16): 0.01})
    logits = np.array([[0.0, 0.015, -1.0], [0.0, 0.5, 0.1], [0.3, 0.3, 0.0]])
    assert uncertain(logits, 2, 16).tolist() == [True, False, True]
    assert uncertain(logits, 3, 16).all()  # not measured: every row
    with pytest.raises(ValueError, match="classes >= 2"):
        uncertain(np.zeros((2, 1)), 2, 16)


@pytest.mark.slow
def test_benchmark_row_measures_the_encrypted_error() -> None:
    pytest.importorskip("tenseal")
    pytest.importorskip("transformers")
    from defense_suite.crypto.benchmark.convert_error import convert_error_benchmark

    params = {"layers": [1], "widths": [4], "sequences": 16, "kinds": ["random"]}
    (row,) = list(convert_error_benchmark(params, [0]))
    assert row.defense == "random L1 d4"
    assert row.utility["sequences"] == 16
    assert 0 < row.utility["max_abs_error"] < 0.05
    assert row.utility["p99_abs_error"] <= row.utility["max_abs_error"]
