"""The row-batched kernel for small K gives the row kernel's results, bit for bit.

:func:`~defenses.ssd.kernels.small.shield_rows_small` serves K <= 16; it must agree
with :func:`~defenses.ssd.kernels.shield.shield_rows` on every answer, label and
returned statistic, for every branch: trivial and non-trivial rows, rows whose
projection ends at its start, prototypes raised to the floor, the ablations (no
temperature, constant budget), given uniforms (input-hash seeding), float32 input,
rows that fail the checks, partial blocks and sub-ranges of rows, and ranges
shorter than, as long as and longer than the answer rows that hold the blocks'
scratch.
"""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest

from defenses.ssd.kernels.lanes import BLOCK_ROWS, TAIL_BLOCK_ROWS, scratch_words
from defenses.ssd.kernels.shield import shield_rows
from defenses.ssd.kernels.small import (
    LARGE_BATCH_TAILS,
    SMALL_K,
    aligned_scratch,
    scratch_start,
    shield_rows_small,
    tail_rows,
)
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


def _whole(f, prototypes, settings, uniforms=None, key=3, counter=0):
    """A case over all rows of ``f`` (drawn from the counter stream by default)."""
    return {
        "f": f,
        "prototypes": prototypes,
        "uniforms": np.empty(0) if uniforms is None else uniforms,
        "key": np.uint64(key),
        "counter": np.uint64(counter),
        "settings": settings,
        "start": 0,
        "stop": f.shape[0],
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
    settings = np.array([2.0, 2.0, 0.5, FLOOR])
    case = _whole(f, prototypes, settings, uniforms=np.zeros(100), key=1)
    _, row_out, _ = _run(shield_rows, case, True)
    _, out, _ = _run(shield_rows_small, case, True)
    np.testing.assert_array_equal(out, row_out)
    np.testing.assert_allclose(out, np.repeat([[FLOOR, 0.5, 0.5]], 100, axis=0))


def _tail_lengths(k: int, itemsize: int) -> list[int]:
    """Row counts for both places of the scratch, around each phase's whole blocks.

    Below ``LARGE_BATCH_TAILS`` 64-row tails the scratch is allocated; from there on
    it is the answer's last rows, and lengths one and a few rows apart give the
    8-row phase and the row kernel different shares.
    """
    large = LARGE_BATCH_TAILS * tail_rows(k, itemsize, BLOCK_ROWS)
    lengths = {1, 7, 8, 63, 64, 65, BLOCK_ROWS + TAIL_BLOCK_ROWS + 3, large - 1}
    for extra in (0, 1, 2, TAIL_BLOCK_ROWS - 1, BLOCK_ROWS - 1, BLOCK_ROWS + 3):
        lengths.add(large + extra)
    for block_rows in (BLOCK_ROWS, TAIL_BLOCK_ROWS):
        tail = tail_rows(k, itemsize, block_rows)
        lengths |= {tail - 1, tail, tail + 1, tail + block_rows + 3}
    return sorted(lengths)


@pytest.mark.parametrize("k", [1, 2, 3, 10, 16])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rows_around_the_scratch_tails_agree(k, dtype):
    # ranges starting inside the array (a thread's chunk), in a batch of their own
    # size (an allocated scratch below LARGE_BATCH_TAILS tails) and in a large one
    # (the scratch in the range's last rows, however short it is), give the row
    # kernel's bits
    rng = np.random.default_rng(k)
    prototypes = np.maximum(rng.dirichlet(np.full(k, 0.3), k), FLOOR)
    prototypes /= prototypes.sum(axis=1, keepdims=True)
    itemsize = np.dtype(dtype).itemsize
    large = LARGE_BATCH_TAILS * tail_rows(k, itemsize, BLOCK_ROWS)
    for n, rows in itertools.product(_tail_lengths(k, itemsize), ("own", "large")):
        batch = n + 40 if rows == "own" else max(n, large) + 40
        f = rng.dirichlet(np.full(k, 0.3), batch).astype(dtype)
        case = {
            "f": f,
            "prototypes": prototypes,
            "uniforms": np.empty(0),
            "key": np.uint64(3),
            "counter": np.uint64(n),
            "settings": np.array([0.5, -1.0, 0.3, FLOOR]),
            "start": 17,
            "stop": 17 + n,
        }
        row_stats, row_out, _ = _run(shield_rows, case, True)
        stats, out, _ = _run(shield_rows_small, case, True)
        np.testing.assert_array_equal(stats, row_stats)
        np.testing.assert_array_equal(out, row_out)
        assert (out[:17] == -7.0).all()
        assert (out[17 + n :] == -7.0).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_scratch_starts_on_a_cache_line_wherever_the_answer_starts(dtype):
    # the answer at every offset its dtype allows within a cache line: the scratch
    # starts on a 64-byte boundary inside the tail rows, and the answers, labels and
    # statistics are the row kernel's
    k = 10
    itemsize = np.dtype(dtype).itemsize
    n = LARGE_BATCH_TAILS * tail_rows(k, itemsize, BLOCK_ROWS) + 5
    f = np.random.default_rng(7).dirichlet(np.full(k, 0.3), n).astype(dtype)
    case = _whole(f, np.full((k, k), 1.0 / k), np.array([0.5, -1.0, 0.3, FLOOR]))
    row_stats, row_out, _ = _run(shield_rows, case, True)
    buffer = np.empty(n * k + 128 // itemsize, dtype=dtype)
    aligned = -buffer.ctypes.data % 64 // itemsize
    for offset in range(64 // itemsize):
        out = buffer[aligned + offset :][: n * k].reshape(n, k)
        for block_rows in (BLOCK_ROWS, TAIL_BLOCK_ROWS):
            first_row = n - tail_rows(k, itemsize, block_rows)
            first = scratch_start(out, first_row)
            assert (out.ctypes.data + first * itemsize) % 64 == 0
            assert first_row * k <= first
            assert first + 8 * scratch_words(k, block_rows) // itemsize <= n * k
        labels = np.empty(0, dtype=np.int64)
        stats = shield_rows_small(
            f, case["prototypes"], case["uniforms"], case["key"], case["counter"],
            case["settings"], MAX_NEWTON_STEPS, 0, n, out, labels,
        )  # fmt: skip
        np.testing.assert_array_equal(stats, row_stats)
        np.testing.assert_array_equal(out, row_out)


@pytest.mark.parametrize("nan_in_tail", [False, True])
def test_the_checks_fold_across_the_phases(nan_in_tail):
    # the largest deviation and the first NaN row come out of whichever phase
    # holds them (at K = 10, float64: rows 0-3583 in 64-row blocks, 3584-3943 in
    # 8-row blocks, the last 56 in the row kernel)
    k, n = 10, 4000
    f = np.random.default_rng(5).dirichlet(np.full(k, 0.3), n)
    f[100] *= 1.001
    f[n - 3] *= 1.002
    valid = f.copy()
    f[n - 300 if nan_in_tail else 50, 0] = np.nan
    case = _whole(f, np.full((k, k), 1.0 / k), np.array([0.5, -1.0, 0.3, FLOOR]))
    row_stats, _, _ = _run(shield_rows, case, True)
    stats, _, _ = _run(shield_rows_small, case, True)
    np.testing.assert_array_equal(stats, row_stats)
    assert stats[1] == (n - 300 if nan_in_tail else 50)
    case["f"] = valid
    row_stats, _, _ = _run(shield_rows, case, True)
    stats, _, _ = _run(shield_rows_small, case, True)
    np.testing.assert_array_equal(stats, row_stats)
    assert stats[1] == n - 3


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_answer_holds_the_scratch(dtype):
    # nothing of a block's size is allocated: the 8-row scratch alone would be
    # scratch_words(10, 8) floats
    k, n = 10, 10_000
    case = _case(0) | {
        "f": np.random.default_rng(6).dirichlet(np.full(k, 0.3), n).astype(dtype),
        "prototypes": np.full((k, k), 1.0 / k),
        "uniforms": np.empty(0),
        "start": 0,
        "stop": n,
    }
    _run(shield_rows_small, case, True)
    out = np.empty((n, k), dtype=dtype)
    labels = np.empty(0, dtype=np.int64)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        shield_rows_small(
            case["f"], case["prototypes"], case["uniforms"], case["key"],
            case["counter"], case["settings"], MAX_NEWTON_STEPS, 0, n, out, labels,
        )  # fmt: skip
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < 8 * scratch_words(k, TAIL_BLOCK_ROWS) / 2


def test_a_small_batch_allocates_one_block_scratch():
    # below LARGE_BATCH_TAILS tails the 64-row scratch is allocated (once, for both
    # phases), on a cache line
    k, n = 10, 256
    case = _whole(
        np.random.default_rng(8).dirichlet(np.full(k, 0.3), n),
        np.full((k, k), 1.0 / k),
        np.array([0.5, -1.0, 0.3, FLOOR]),
    )
    _run(shield_rows_small, case, True)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        _run(shield_rows_small, case, True)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    answer = n * k * 8
    assert answer + 8 * scratch_words(k, BLOCK_ROWS) <= peak
    assert peak < answer + 8 * scratch_words(k, BLOCK_ROWS) + 2048
    for words in (1, 7, 100, scratch_words(k, BLOCK_ROWS)):
        scratch = aligned_scratch(words)
        assert scratch.shape == (words,)
        assert scratch.ctypes.data % 64 == 0


def _newton_steps(f_row, q_row, h: float, sign: float) -> int:
    """Steps of :func:`~defenses.ssd.kernels.projection._level` for one level."""
    q = np.maximum(q_row, FLOOR)
    start = 1.0 / (q.sum() if (q_row < FLOOR).any() else 1.0)
    ratio = f_row / q
    alive = sign * (ratio - start) < 0.0
    steps = 0
    while alive.any():
        steps += 1
        level = (f_row[alive].sum() + sign * h) / q[alive].sum()
        kept = alive & (sign * (ratio - level) < 0.0)
        if kept.sum() in (alive.sum(), 0):
            break
        alive = kept
    return steps


@pytest.mark.parametrize("k", [3, 5, 10, 16])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rows_of_a_block_ending_after_different_steps_agree(k, dtype):
    # a block's lockstep runs until its slowest row ends; the rows that ended
    # earlier keep their levels through the later steps (the selects of the
    # step's end) and give the row kernel's bits, for both levels
    rng = np.random.default_rng(40 + k)
    n = 3 * BLOCK_ROWS + 5
    alpha = np.where(np.arange(n) % 2 == 0, 0.05, 3.0)[:, None]
    f = rng.dirichlet(np.ones(k), n) ** (1.0 / alpha)
    f = (f / f.sum(axis=1, keepdims=True)).astype(dtype)
    prototypes = np.maximum(rng.dirichlet(np.full(k, 0.3), k), FLOOR)
    prototypes /= prototypes.sum(axis=1, keepdims=True)
    settings = np.array([0.25, -1.0, 0.5, FLOOR])
    case = _whole(f, prototypes, settings, uniforms=rng.random(n))
    _, row_out, _ = _run(shield_rows, case, True)
    _, _, labels = _run(shield_rows, case, False)
    _, out, _ = _run(shield_rows_small, case, True)
    np.testing.assert_array_equal(out, row_out)
    f64 = f.astype(np.float64)
    h = 0.5 * 0.25 * -(f64 * np.log(np.maximum(f64, 1e-300))).sum(axis=1)
    first = [
        [_newton_steps(f64[r], prototypes[labels[r]], h[r], s) for r in range(64)]
        for s in (1.0, -1.0)
    ]
    # the first block holds rows ending after one step and rows going on longer
    # (at K = 2 an active set has one index: every level ends in one step)
    assert min(max(steps) for steps in first) >= 2
    assert max(min(s for s in steps if s) for steps in first) == 1
