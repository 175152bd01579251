"""The row-batched kernel for small K gives the row kernel's results, bit for bit.

:func:`~defenses.ssd.kernels.small.shield_rows_small` serves K <= 16; it must agree
with :func:`~defenses.ssd.kernels.shield.shield_rows` on every answer, label and
returned statistic, for every branch: trivial and non-trivial rows, rows whose
projection ends at its start, prototypes raised to the floor, the ablations (no
temperature, constant budget), given uniforms (input-hash seeding), float32 input,
rows that fail the checks, partial blocks and sub-ranges of rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from defenses.ssd.kernels.shield import shield_rows
from defenses.ssd.kernels.small import BLOCK_ROWS, SMALL_K, shield_rows_small
from defenses.ssd.waterfill import FLOOR, MAX_NEWTON_STEPS


def _case(seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, SMALL_K + 1))
    n = int(rng.integers(1, 3 * BLOCK_ROWS + 5))
    alpha = float(rng.choice([0.05, 0.3, 1.0, 5.0]))
    f = rng.dirichlet(np.full(k, alpha), n)
    if seed % 5 == 0:
        f = f.astype(np.float32)
    if seed % 7 == 0 and n > 3:
        f[1] = np.nan if seed % 2 else np.inf
        f[2, 0] = -0.1
    if seed % 11 == 0:
        f[::3] = np.eye(k)[0]
    prototypes = np.maximum(rng.dirichlet(np.full(k, alpha), k), FLOOR)
    prototypes /= prototypes.sum(axis=1, keepdims=True)
    if seed % 13 == 0:
        prototypes[0, 0] = 0.0  # below the floor: never the trivial branch
    temperature = 0.0 if seed % 4 == 0 else float(rng.choice([0.2, 1.0, 1e-300]))
    settings = np.array(
        [
            float(rng.choice([0.1, 0.5, 1.5, 2.0])),
            0.3 if seed % 17 == 0 else -1.0,
            temperature,
            FLOOR,
        ]
    )
    start = int(rng.integers(0, n))
    return {
        "f": f,
        "prototypes": prototypes,
        "uniforms": rng.random(n) if seed % 3 == 0 else np.empty(0),
        "key": np.uint64(rng.integers(0, 2**63)),
        "counter": np.uint64(rng.integers(0, 1000)),
        "settings": settings,
        "start": start,
        "stop": int(rng.integers(start, n + 1)),
    }


def _run(kernel, case, answers: bool):
    f = case["f"]
    n, k = f.shape
    out = np.full((n if answers else 0, k), -7.0, dtype=f.dtype)
    labels = np.full(0 if answers else n, -5, dtype=np.int64)
    stats = kernel(
        f, case["prototypes"], case["uniforms"], case["key"], case["counter"],
        case["settings"], MAX_NEWTON_STEPS, case["start"], case["stop"], out, labels,
    )  # fmt: skip
    return stats, out, labels


@pytest.mark.parametrize("seed", range(120))
@pytest.mark.parametrize("answers", [True, False])
def test_the_small_kernel_is_the_row_kernel_bit_for_bit(seed, answers):
    case = _case(seed)
    row_stats, row_out, row_labels = _run(shield_rows, case, answers)
    stats, out, labels = _run(shield_rows_small, case, answers)
    np.testing.assert_array_equal(stats, row_stats)
    f = case["f"]
    checked = np.zeros(f.shape[0], dtype=bool)
    checked[case["start"] : case["stop"]] = np.isfinite(f).all(axis=1)[
        case["start"] : case["stop"]
    ]
    if answers:
        np.testing.assert_array_equal(out[checked], row_out[checked])
        np.testing.assert_array_equal(out[~checked], row_out[~checked])
    else:
        np.testing.assert_array_equal(labels[checked], row_labels[checked])


def test_rows_whose_projection_ends_at_its_start_agree():
    # label 0 everywhere (u = 0), its prototype below the floor, budget 2: every row
    # fails the trivial test (a raised entry) and ends at the floored prototype
    f = np.random.default_rng(0).dirichlet(np.ones(3), 100)
    prototypes = np.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.6, 0.2, 0.2]])
    case = {
        "f": f,
        "prototypes": prototypes,
        "uniforms": np.zeros(100),
        "key": np.uint64(1),
        "counter": np.uint64(0),
        "settings": np.array([2.0, 2.0, 0.5, FLOOR]),
        "start": 0,
        "stop": 100,
    }
    _, row_out, _ = _run(shield_rows, case, True)
    _, out, _ = _run(shield_rows_small, case, True)
    np.testing.assert_array_equal(out, row_out)
    np.testing.assert_allclose(out, np.repeat([[FLOOR, 0.5, 0.5]], 100, axis=0))
