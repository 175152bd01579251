"""The water-filling projection: golden vectors, reference solver, invariants, edges."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from defenses.ssd import waterfill
from defenses.ssd.solver import kl_objective, solve_reference
from defenses.ssd.waterfill import water_filling

GOLDEN = [
    ([0.7, 0.2, 0.1], [0.1, 0.3, 0.6], 0.4, [0.5, 0.2, 0.3]),
    ([0.7, 0.2, 0.1], [0.1, 0.3, 0.6], 1.2, [0.1, 0.3, 0.6]),
    ([0.5, 0.3, 0.15, 0.05], [0.05, 0.05, 0.1, 0.8], 0.3, [0.35, 0.3, 0.15, 0.2]),
    ([0.25] * 4, [0.97, 0.01, 0.01, 0.01], 0.5, [0.5, 1 / 6, 1 / 6, 1 / 6]),
]


def _instances(rng: np.random.Generator, n: int, k: int, alpha: float = 1.0):
    f = rng.dirichlet(np.full(k, alpha), n)
    q = rng.dirichlet(np.full(k, alpha), n)
    budget = rng.uniform(0.0, 2.2, n)
    return f, q, budget


@pytest.mark.parametrize(("f", "q", "budget", "expected"), GOLDEN)
def test_golden_vectors_numpy_and_torch(f, q, budget, expected):
    out = water_filling(np.array([f]), np.array([q]), np.array([budget]))
    np.testing.assert_allclose(out[0], expected, atol=1e-12)
    out_t = water_filling(
        torch.tensor([f], dtype=torch.float64),
        torch.tensor([q], dtype=torch.float64),
        torch.tensor([budget], dtype=torch.float64),
    )
    assert isinstance(out_t, torch.Tensor)
    np.testing.assert_allclose(out_t.numpy()[0], expected, atol=1e-12)


def test_golden_vectors_batched_together():
    # rows of different K cannot share a batch: check the K=3 and K=4 groups
    for k in (3, 4):
        rows = [g for g in GOLDEN if len(g[0]) == k]
        out = water_filling(
            np.array([g[0] for g in rows]),
            np.array([g[1] for g in rows]),
            np.array([g[2] for g in rows]),
        )
        np.testing.assert_allclose(out, np.array([g[3] for g in rows]), atol=1e-12)


@pytest.mark.parametrize("k", [2, 3, 10, 100, 129, 1000])
def test_numpy_and_torch_agree(k):
    rng = np.random.default_rng(k)
    f, q, budget = _instances(rng, 300, k, alpha=0.3)
    a = water_filling(f, q, budget)
    t = water_filling(
        torch.from_numpy(f), torch.from_numpy(q), torch.from_numpy(budget)
    )
    np.testing.assert_allclose(a, t.numpy(), atol=1e-12)


@pytest.mark.parametrize("k", [2, 3, 10, 129, 1000])
def test_batched_equals_row_by_row(k):
    rng = np.random.default_rng(7 + k)
    f, q, budget = _instances(rng, 40, k)
    batched = water_filling(f, q, budget)
    rows = np.vstack(
        [
            water_filling(f[i : i + 1], q[i : i + 1], budget[i : i + 1])
            for i in range(40)
        ]
    )
    np.testing.assert_allclose(batched, rows, atol=1e-14)


def test_matches_cvxpy_objective_on_well_conditioned_instances():
    rng = np.random.default_rng(0)
    f = rng.dirichlet(np.full(6, 3.0), 12)
    q = rng.dirichlet(np.full(6, 3.0), 12)
    budget = rng.uniform(0.05, 0.6, 12)
    ours = water_filling(f, q, budget)
    ref = solve_reference(f, q, budget)
    gap = kl_objective(ours, q) - kl_objective(ref, q)
    assert np.all(gap <= 1e-7)
    np.testing.assert_allclose(ours, ref, atol=1e-4)


@pytest.mark.parametrize("steps", [0, 1, 2])
@pytest.mark.parametrize("k", [2, 20, 300])
def test_sorting_fallback_matches_newton(monkeypatch, k, steps):
    rng = np.random.default_rng(3)
    f, q, budget = _instances(rng, 500, k, alpha=0.3)
    newton = water_filling(f, q, budget)
    monkeypatch.setattr(waterfill, "MAX_NEWTON_STEPS", steps)
    np.testing.assert_allclose(water_filling(f, q, budget), newton, atol=1e-14)


def test_tied_ratios_match_the_sorting_algorithm():
    # equal ratios (f = c q on blocks of coordinates) put Newton's levels on kinks
    rng = np.random.default_rng(9)
    q = rng.dirichlet(np.full(12, 1.0), 200)
    scale = np.repeat(rng.choice([0.0, 0.5, 1.0, 2.0], size=(200, 4)), 3, axis=1)
    scale[:, :3] = 1.0
    f = scale * q
    f /= f.sum(axis=1, keepdims=True)
    budget = rng.uniform(0.0, 1.5, 200)
    expected = water_filling(torch.from_numpy(f), torch.from_numpy(q), budget)
    p = water_filling(f, q, budget)
    np.testing.assert_allclose(p, expected.numpy(), atol=1e-13)
    assert np.all(np.abs(p - f).sum(axis=1) <= budget + 1e-13)


def _simplex(k_max: int = 12):
    return st.integers(2, k_max).flatmap(
        lambda k: st.tuples(
            st.lists(st.floats(0.0, 1.0), min_size=k, max_size=k).filter(
                lambda v: sum(v) > 1e-3
            ),
            st.lists(st.floats(1e-6, 1.0), min_size=k, max_size=k),
            st.floats(0.0, 2.5),
        )
    )


@settings(max_examples=100, deadline=None)
@given(_simplex())
def test_invariants(case):
    raw_f, raw_q, budget = case
    f = np.array([raw_f]) / np.sum(raw_f)
    q = np.array([raw_q]) / np.sum(raw_q)
    p = water_filling(f, q, np.array([budget]))
    assert np.all(np.isfinite(p))
    assert np.all(p >= -1e-15)
    assert abs(p.sum() - 1.0) < 1e-12
    spent = np.abs(p - f).sum()
    assert spent <= budget + 1e-12
    lo, hi = np.minimum(f, q), np.maximum(f, q)
    assert np.all(p >= lo - 1e-12)
    assert np.all(p <= hi + 1e-12)
    if np.abs(q - f).sum() <= budget:
        np.testing.assert_allclose(p, q, atol=1e-12)
    else:
        assert spent == pytest.approx(budget, abs=1e-10)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**32 - 1))
def test_no_feasible_point_beats_the_projection(k, seed):
    rng = np.random.default_rng(seed)
    f, q, budget = _instances(rng, 1, k)
    p = water_filling(f, q, budget)
    best = kl_objective(p, q)[0]
    for _ in range(20):
        direction = rng.normal(size=k)
        direction -= direction.mean()
        candidate = p + 1e-3 * direction
        if candidate.min() < 0 or np.abs(candidate - f).sum() > budget[0]:
            continue
        assert kl_objective(candidate, q)[0] >= best - 1e-12


def test_budget_above_two_returns_q():
    rng = np.random.default_rng(1)
    f, q, _ = _instances(rng, 50, 30)
    np.testing.assert_array_equal(water_filling(f, q, np.full(50, 3.45)), q)


def test_zero_budget_returns_f():
    rng = np.random.default_rng(2)
    f, q, _ = _instances(rng, 50, 7)
    np.testing.assert_allclose(water_filling(f, q, np.zeros(50)), f, atol=1e-15)


def test_zeros_and_one_hots_give_no_nan():
    f = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0]])
    q = np.array([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    p = water_filling(f, q, np.array([0.3, 0.1, 1.0]))
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-12)
    assert np.all(np.abs(p - f).sum(axis=1) <= np.array([0.3, 0.1, 1.0]) + 1e-12)


def test_float32_underflow_at_k1000():
    logits = torch.zeros(4, 1000, dtype=torch.float32)
    logits[:, 0] = 200.0
    f = torch.softmax(logits, dim=1)
    assert float(f[0, 1]) == 0.0
    q = torch.softmax(-logits, dim=1)
    p = water_filling(f, q, torch.full((4,), 0.05))
    assert p.dtype == torch.float32
    assert torch.all(torch.isfinite(p))
    np.testing.assert_allclose(p.sum(1).numpy(), 1.0, atol=1e-5)


def test_k_equals_one_and_empty_batch():
    np.testing.assert_array_equal(
        water_filling(np.ones((3, 1)), np.ones((3, 1)), np.zeros(3)), 1.0
    )
    assert water_filling(np.zeros((0, 4)), np.zeros((0, 4)), np.zeros(0)).shape == (
        0,
        4,
    )


def test_float32_in_float32_out():
    rng = np.random.default_rng(5)
    f, q, b = _instances(rng, 10, 5)
    out = water_filling(f.astype(np.float32), q.astype(np.float32), b)
    assert out.dtype == np.float32


@pytest.mark.parametrize(
    ("f", "q", "budget", "match"),
    [
        (np.ones((2, 3)) / 3, np.ones((2, 4)) / 4, np.zeros(2), "same shape"),
        (np.ones(3) / 3, np.ones(3) / 3, np.zeros(1), "same shape"),
        (np.array([[0.5, 0.6, -0.1]]), np.ones((1, 3)) / 3, np.zeros(1), "negative"),
        (np.array([[0.5, 0.6, 0.1]]), np.ones((1, 3)) / 3, np.zeros(1), "sum to 1"),
        (np.array([[np.nan, 0.5, 0.5]]), np.ones((1, 3)) / 3, np.zeros(1), "NaN"),
        (np.ones((1, 3)) / 3, np.array([[np.inf, 0, 0]]), np.zeros(1), "NaN or inf"),
        (
            np.ones((1, 3)) / 3,
            np.ones((1, 3)) / 3,
            np.array([-0.1]),
            "budget must be >= 0",
        ),
        (
            np.ones((1, 3)) / 3,
            np.ones((1, 3)) / 3,
            np.zeros(2),
            r"budget must have shape \(1,\)",
        ),
        (
            np.ones((1, 3)) / 3,
            np.ones((1, 3)) / 3,
            np.array([np.nan]),
            "budget contains NaN",
        ),
    ],
)
def test_bad_input_raises(f, q, budget, match):
    # the closed form and the reference solver take their inputs through one check
    for solve in (water_filling, solve_reference):
        with pytest.raises(ValueError, match=match):
            solve(f, q, budget)
    if f.ndim == 2 and f.shape == q.shape:
        with pytest.raises(ValueError, match=match):
            water_filling(
                torch.from_numpy(f), torch.from_numpy(q), torch.from_numpy(budget)
            )


def test_mixed_torch_and_numpy_is_refused():
    with pytest.raises(TypeError, match="both be torch tensors"):
        water_filling(torch.ones(1, 2) / 2, np.ones((1, 2)) / 2, np.zeros(1))
