"""The numpy twins of SSD's kernels (:mod:`defenses.ssd.kernels.plain`) are bit-exact.

While a kernel compiles in the background its calls are answered by the twin, so
the twin must give the kernel's bits: answers, labels, the input checks' statistics,
on random rows and on the edges (one-hot and uniform rows, exact zeros, ties in the
ratios, floored prototypes, constant budgets, no temperature, given uniforms, rows
with NaN, inf or negative entries, and the sort fallback of the Newton levels).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from defenses.ssd import StealthyShield, water_filling
from defenses.ssd.batch import frozen
from defenses.ssd.kernels import background, plain
from defenses.ssd.kernels.blake2b import IV, blake2b_rows
from defenses.ssd.kernels.projection import project_rows
from defenses.ssd.kernels.shield import shield_rows
from defenses.ssd.kernels.small import shield_rows_small


def same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def edge_rows(rng: np.random.Generator, n: int, k: int, ties: bool) -> np.ndarray:
    """Dirichlet rows of several concentrations, with one-hot, uniform and tied rows."""
    f = rng.dirichlet(np.full(k, rng.choice([0.05, 0.5, 5.0])), size=n)
    if ties:
        f = np.round(f * 6.0)
        f[f.sum(axis=1) == 0, 0] = 1.0
        f /= f.sum(axis=1, keepdims=True)
    f[0] = 0.0
    f[0, k // 2] = 1.0
    f[-1] = 1.0 / k
    return f


def run_shield(kernel: Any, f, protos, uniforms, settings, steps, answers) -> tuple:
    n, k = f.shape
    out = np.empty((n if answers else 0, k), dtype=f.dtype)
    labels = np.empty(0 if answers else n, dtype=np.int64)
    stats = kernel(
        frozen(f), frozen(protos), frozen(uniforms), np.uint64(2**63 + 12345),
        np.uint64(2**64 - 5), settings, steps, 0, n, out, labels,
    )  # fmt: skip
    return out, labels, np.asarray(stats)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 10, 16, 17, 40])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("answers", [True, False])
def test_the_shield_twin_is_the_kernel_bit_for_bit(k, dtype, answers):
    rng = np.random.default_rng(k)
    for case in range(6):
        f = edge_rows(rng, 97, k, ties=bool(case % 2)).astype(dtype)
        protos = rng.dirichlet(np.full(k, 0.3), size=k)
        if case % 3 == 0 and k > 1:
            protos[:, 0] = 0.0  # floored entries
            protos /= protos.sum(axis=1, keepdims=True)
        settings = np.array(
            [[0.5, 2.0, 0.05][case % 3], 0.3 if case == 4 else -1.0,
             0.0 if case == 5 else 0.1, 1e-12]
        )  # fmt: skip
        uniforms = rng.random(97) if case % 2 else np.empty(0)
        want = run_shield(shield_rows, f, protos, uniforms, settings, 32, answers)
        got = run_shield(plain.shield_rows, f, protos, uniforms, settings, 32, answers)
        assert all(same_bits(a, b) for a, b in zip(want, got, strict=True)), case
        if k <= 16:
            small = run_shield(
                shield_rows_small, f, protos, uniforms, settings, 32, answers
            )
            assert all(same_bits(a, b) for a, b in zip(small, got, strict=True)), case


@pytest.mark.parametrize("bad", ["nan", "inf", "negative", "off-sum"])
def test_the_checks_statistics_are_the_kernels(bad):
    rng = np.random.default_rng(3)
    f = rng.dirichlet(np.ones(10), size=200)
    protos = rng.dirichlet(np.ones(10), size=10)
    rows = [40, 150]
    for row in rows:
        f[row, 3] = {"nan": np.nan, "inf": np.inf, "negative": -0.1, "off-sum": 0.4}[
            bad
        ]
    settings = np.array([0.5, -1.0, 0.1, 1e-12])
    want = run_shield(shield_rows, f, protos, np.empty(0), settings, 32, True)
    got = run_shield(plain.shield_rows, f, protos, np.empty(0), settings, 32, True)
    assert same_bits(want[2], got[2])
    good = np.isfinite(f).all(axis=1)
    assert same_bits(want[0][good], got[0][good])


@pytest.mark.parametrize("steps", [0, 1])
def test_the_sort_fallback_walks_ties_in_the_kernels_order(steps, monkeypatch):
    walks = []
    walk = plain._walk
    monkeypatch.setattr(plain, "_walk", lambda *a: walks.append(1) or walk(*a))
    rng = np.random.default_rng(steps)
    f = edge_rows(rng, 60, 40, ties=True)
    q = edge_rows(rng, 60, 40, ties=True)[::-1].copy()
    half = rng.random(60) * 0.4
    want_out, want_stats = np.empty_like(f), np.empty((60, 4))
    project_rows(frozen(f), frozen(q), 1e-12, frozen(half), steps, want_stats, want_out)
    got_out, got_stats = np.empty_like(f), np.empty((60, 4))
    plain.project_rows(f, q, 1e-12, half, steps, got_stats, got_out)
    assert same_bits(want_out, got_out)
    assert same_bits(want_stats, got_stats)
    assert len(walks) > 10  # the fallback ran


@pytest.mark.parametrize("length", [0, 1, 8, 127, 128, 129, 300])
def test_the_hash_twin_is_the_kernel(length):
    rng = np.random.default_rng(length)
    blocks = max(1, -(-length // 128))
    buffer = rng.integers(0, 256, size=(33, blocks * 128), dtype=np.uint8)
    buffer[:, length:] = 0
    key = np.uint64(0x0123456789ABCDEF)
    want = blake2b_rows(buffer.view(np.uint64), length, key, IV)
    assert same_bits(want, plain.blake2b_rows(buffer.view(np.uint64), length, key, IV))


def twin_only(kernel: Any, fallback: Any, args: tuple) -> Any:
    return fallback


@pytest.mark.parametrize("seeding", ["random", "input-hash"])
@pytest.mark.parametrize("k", [4, 30])
def test_a_shield_answers_the_same_from_either_path(seeding, k, monkeypatch):
    rng = np.random.default_rng(k)
    val = rng.dirichlet(np.ones(k), size=5 * k)
    f = edge_rows(rng, 300, k, ties=False)
    answers = []
    for path in ("kernel", "twin"):
        if path == "twin":
            monkeypatch.setattr(background, "pick", twin_only)
        shield = StealthyShield(seed=7, seeding=seeding, n_threads=1)
        shield.fit(val, np.arange(5 * k) % k)
        answers.append(
            (shield(f), shield(f.astype(np.float32)), shield.pseudo_labels(f))
        )
        answers.append(water_filling(f, f[::-1], np.linspace(0, 1, 300)))
    assert all(same_bits(a, b) for a, b in zip(answers[0], answers[2], strict=True))
    assert same_bits(answers[1], answers[3])


def test_the_twins_extra_memory_does_not_grow_with_the_batch(monkeypatch):
    # rows are processed in chunks of CHUNK_ENTRIES entries: about 10 MB of
    # temporaries beside the answer at any N (measured 7.6 MB at N = 10,000 and
    # 10.0 MB at N = 100,000, K = 10); the input here is 4.8 MB
    import tracemalloc

    monkeypatch.setattr(background, "pick", twin_only)
    rng = np.random.default_rng(0)
    f = rng.dirichlet(np.ones(10), size=60_000)
    shield = StealthyShield(seed=0, n_threads=1).fit(f[:20], np.arange(20) % 10)
    shield(f[:5])
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        shield(f)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak - f.nbytes < 16e6
