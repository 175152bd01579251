"""The Python around the kernel: the input checks across blocks and the kernel's key."""

from __future__ import annotations

import numpy as np
import pytest

from defenses.jit import compile_in_call
from defenses.ssd.batch import check_stats, frozen
from defenses.ssd.kernels import background
from defenses.ssd.kernels.calls import shield_kernel
from defenses.ssd.kernels.shield import shield_rows
from defenses.ssd.kernels.small import shield_rows_small
from defenses.ssd.waterfill import FLOOR, MAX_NEWTON_STEPS


def _blocks(*rows):
    return [np.array(row, dtype=np.float64) for row in rows]


def test_the_worst_row_of_every_block_is_named():
    # the largest deviation wins across blocks, the earlier block on a tie
    blocks = _blocks([1e-3, 7, 0], [2e-3, 4100, 0], [2e-3, 9000, 0])
    with pytest.raises(ValueError, match=r"row 4100 is off by 0\.002"):
        check_stats(blocks, 1e-6)
    check_stats(blocks, 3e-3)


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        (_blocks([1e-9, 0, 0], [np.nan, 12, 0]), "NaN or inf"),
        (_blocks([1e-9, 0, 0], [1e-9, 5, -1]), "negative"),
        (_blocks([np.nan, 3, -1]), "NaN or inf"),
    ],
)
def test_bad_rows_in_any_block_raise(blocks, message):
    with pytest.raises(ValueError, match=message):
        check_stats(blocks, 1e-6)


def _args(rows):
    k = rows.shape[1]
    settings = np.array([0.5, -1.0, 0.3, FLOOR])
    out = np.empty_like(rows)
    return (
        frozen(rows), frozen(np.full((k, k), 1.0 / k)), frozen(np.empty(0)),
        np.uint64(1), np.uint64(0), settings, MAX_NEWTON_STEPS, 0, len(rows), out,
        np.empty(0, dtype=np.int64),
    )  # fmt: skip


def test_the_kernel_is_keyed_by_the_rows_dtype():
    rng = np.random.default_rng(0)
    rows = rng.dirichlet(np.ones(10), 5)
    with compile_in_call():  # the kernels compile (or load) in the call
        assert shield_kernel(_args(rows)) is shield_rows_small
        assert shield_kernel(_args(rows.astype(np.float32))) is shield_rows_small
        assert shield_kernel(_args(rng.dirichlet(np.ones(20), 5))) is shield_rows
    background._READY.clear()
    assert shield_kernel(_args(rows)) is shield_rows_small
    assert shield_kernel(_args(rows.astype(np.float32))) is shield_rows_small
    keys = {(id(shield_rows_small), (dtype, True)) for dtype in ("<f8", "<f4")}
    assert keys == background._READY
