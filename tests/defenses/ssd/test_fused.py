"""The fused call: same bits whatever the threads and blocks, same draw, one copy."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from numba import njit
from scipy.stats import chisquare

from defenses.ssd.defense import StealthyShield, entropy
from defenses.ssd.kernels.elementary import GOLDEN, exp_row, log_row
from defenses.ssd.kernels.plain import exp_rows, log_rows
from defenses.ssd.kernels.shield import shield_rows
from defenses.ssd.waterfill import FLOOR, MAX_NEWTON_STEPS, water_filling


def _shield(k: int, **kwargs) -> StealthyShield:
    rng = np.random.default_rng(0)
    val = rng.dirichlet(np.full(k, 0.3), 10 * k)
    return StealthyShield(seed=5, **kwargs).fit(val, np.arange(10 * k) % k)


def _splitmix(key: np.uint64, index: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = key + index.astype(np.uint64) * GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


@pytest.mark.parametrize(("k", "n"), [(100, 3000), (10, 30000)])
def test_threads_and_blocks_give_the_same_bits(k, n):
    probs = np.random.default_rng(1).dirichlet(np.full(k, 0.3), n)
    one = _shield(k, n_threads=1)(probs)
    two = _shield(k, n_threads=2)(probs)
    np.testing.assert_array_equal(one, two)
    split = _shield(k, n_threads=1)
    halves = np.vstack([split(probs[:1234]), split(probs[1234:])])
    np.testing.assert_array_equal(one, halves)
    again = _shield(k, n_threads=1)
    again(probs)
    assert not np.array_equal(again(probs), one)  # the stream moves on


@pytest.mark.parametrize("k", [20, 10])
def test_the_draw_is_the_inverse_cdf_of_the_temperature_softmax(k):
    shield = _shield(k, temperature=0.3)
    probs = np.random.default_rng(2).dirichlet(np.full(k, 0.5), 4000)
    u = _splitmix(shield.key_, np.arange(4000))
    weights = np.exp((probs - probs.max(axis=1, keepdims=True)) / 0.3)
    cdf = np.cumsum(weights, axis=1)
    threshold = u * cdf[:, -1]
    expected = np.argmax(cdf > threshold[:, None], axis=1)
    margin = np.min(np.abs(cdf - threshold[:, None]), axis=1)
    labels = shield.pseudo_labels(probs)
    clear = margin > 1e-12 * cdf[:, -1]
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(labels[clear], expected[clear])


def test_pseudo_labels_follow_sampling_probs():
    shield = _shield(6, temperature=0.2)
    row = np.array([[0.3, 0.25, 0.2, 0.15, 0.07, 0.03]])
    labels = shield.pseudo_labels(np.repeat(row, 20000, axis=0))
    counts = np.bincount(labels, minlength=6)
    expected = shield.sampling_probs(row)[0] * 20000
    assert chisquare(counts, expected).pvalue > 1e-4


@pytest.mark.parametrize("k", [30, 10, 3])
def test_answers_are_the_projection_towards_the_drawn_prototype(k):
    probs = np.random.default_rng(3).dirichlet(np.full(k, 0.3), 2000)
    labels = _shield(k, epsilon=0.4).pseudo_labels(probs)
    answers = _shield(k, epsilon=0.4)(probs)
    prototypes = _shield(k).prototypes_
    expected = water_filling(probs, prototypes[labels], 0.4 * entropy(probs))
    np.testing.assert_allclose(answers, expected, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_extra_memory_is_the_answer_alone(dtype, monkeypatch):
    monkeypatch.setenv("DEFENSE_SUITE_JIT", "inline")  # the kernel's, not the twin's
    probs = np.random.default_rng(4).dirichlet(np.full(50, 0.3), 20000).astype(dtype)
    probs /= probs.sum(axis=1, keepdims=True)
    shield = _shield(50, n_threads=2)
    shield(probs[:10])
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        answers = shield(probs)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert answers.dtype == dtype
    assert peak <= 1.02 * probs.nbytes + 65536


@pytest.mark.parametrize(("n", "threads"), [(10_000, 1), (30_000, 2)])
def test_at_small_k_the_answer_holds_the_kernel_scratch(n, threads, monkeypatch):
    monkeypatch.setenv("DEFENSE_SUITE_JIT", "inline")  # the kernel's, not the twin's
    # the row-batched kernel's blocks live in answer rows not yet written, so the
    # first call of a new shield allocates the answer and 1 % more (30,000 rows
    # at K = 10 are split among threads, each chunk holding its own scratch)
    probs = np.random.default_rng(4).dirichlet(np.full(10, 0.3), n)
    _shield(10, n_threads=threads)(probs)  # compiles the kernels
    shield = _shield(10, n_threads=threads)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        shield(probs)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak <= 1.01 * probs.nbytes


def test_a_torch_tensor_is_read_in_place_and_answered_in_kind():
    probs = torch.distributions.Dirichlet(torch.full((8,), 0.5)).sample((300,))
    answers = _shield(8)(probs)
    assert isinstance(answers, torch.Tensor)
    assert answers.dtype == torch.float32
    torch.testing.assert_close(answers.sum(1), torch.ones(300), atol=1e-5, rtol=0)


@njit(error_model="numpy", cache=True)
def _log(x: np.ndarray) -> np.ndarray:
    rows = np.empty((3, x.shape[0]))
    rows[0] = x
    log_row(rows[0], rows[1], rows[2], rows.view(np.int64))
    return rows[1].copy()


@njit(error_model="numpy", cache=True)
def _exp(a: np.ndarray) -> np.ndarray:
    rows = np.empty((2, a.shape[0]))
    rows[0] = a
    exp_row(rows[0], rows[0], rows[1], rows.view(np.int64)[1])
    return rows[0].copy()


def test_row_log_and_exp_are_within_one_ulp_of_numpy():
    rng = np.random.default_rng(5)
    x = np.concatenate(
        [10 ** rng.uniform(-307, 0, 50000), rng.uniform(0, 1, 50000), [1.0, 2**-1022]]
    )
    ulps = np.abs(_log(x) - np.log(x)) / np.spacing(np.abs(np.log(x)) + 1e-300)
    assert ulps.max() <= 1.0
    a = np.concatenate([-rng.uniform(0, 708, 50000), -rng.uniform(0, 1, 50000), [0.0]])
    assert (np.abs(_exp(a) - np.exp(a)) / np.spacing(np.exp(a))).max() <= 1.0
    assert (_exp(np.array([-708.5, -1e300, -np.inf, np.nan])) == 0.0).all()
    # the numpy mirror (the answers while the kernels compile) gives the same bits
    edges = np.array([0.0, -0.0, -708.0, -708.5, -np.inf, np.nan, -5e-324, -1e-300])
    np.testing.assert_array_equal(_exp(a).view(np.int64), exp_rows(a).view(np.int64))
    np.testing.assert_array_equal(
        _exp(edges).view(np.int64), exp_rows(edges).view(np.int64)
    )
    np.testing.assert_array_equal(_log(x).view(np.int64), log_rows(x).view(np.int64))


def _reference_trivial(f_row: np.ndarray, q: np.ndarray, half: float) -> bool:
    below_f = below_q = 0.0
    for fv, qv in zip(f_row.tolist(), q.tolist(), strict=True):
        if fv < qv:
            below_f += fv
            below_q += qv
    return below_q - below_f <= half


@pytest.mark.parametrize("k", [17, 100, 1000])
def test_the_trivial_test_at_its_boundary_is_the_reference_sums(k):
    # the row kernel decides the trivial test from vectorized sums unless they are
    # within their rounding bound of the budget; a budget equal to the reference's
    # excess (and one float below it) must give the reference's verdict
    rng = np.random.default_rng(k)
    prototypes = np.maximum(rng.dirichlet(np.full(k, 0.3), k), 2 * FLOOR)
    prototypes /= prototypes.sum(axis=1, keepdims=True)
    for _ in range(5):
        f = rng.dirichlet(np.full(k, 0.3), 1)
        settings = np.array([0.5, -1.0, 0.3, FLOOR])
        run = (f, prototypes, np.zeros(1), np.uint64(0), np.uint64(0))
        labels = np.empty(1, dtype=np.int64)
        shield_rows(*run, settings, MAX_NEWTON_STEPS, 0, 1, np.empty((0, k)), labels)
        q = prototypes[labels[0]]
        excess = sum(qv for fv, qv in zip(f[0], q, strict=True) if fv < qv) - sum(
            fv for fv, qv in zip(f[0], q, strict=True) if fv < qv
        )
        for half in (excess, np.nextafter(excess, -np.inf)):
            settings[1] = 2.0 * half
            out = np.empty((1, k))
            shield_rows(*run, settings, MAX_NEWTON_STEPS, 0, 1, out, labels)
            trivial = _reference_trivial(f[0], q, half)
            assert trivial == (half == excess)
            assert np.array_equal(out[0], q) == trivial
