from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from defenses.civet.bounds import Box
from defenses.civet.support import (
    box_mass,
    check_levels,
    exact_halfwidths,
    expected_bound,
    halfwidth,
    layer_cake_weights,
    support_box,
)

# (p, d) -> k from the research note's table (two decimals)
GOLDEN = [
    (0.50, 2, 1.05),
    (0.75, 4, 1.82),
    (0.90, 8, 2.48),
    (0.95, 4, 2.49),
    (0.95, 16, 2.95),
    (0.99, 2, 2.81),
    (0.99, 128, 3.95),
]


@pytest.mark.parametrize(("p", "d", "k"), GOLDEN)
def test_halfwidth_matches_the_table(p: float, d: int, k: float) -> None:
    assert halfwidth(p, d) == pytest.approx(k, abs=0.006)


@settings(max_examples=50, deadline=None)
@given(p=st.floats(0.01, 0.999), d=st.integers(1, 64))
def test_box_mass_is_exactly_p(p: float, d: int) -> None:
    assert box_mass(halfwidth(p, d), d) == pytest.approx(p, rel=1e-9)


def test_box_mass_by_sampling() -> None:
    d, p = 4, 0.9
    k = halfwidth(p, d)
    nu = np.random.default_rng(0).standard_normal((200_000, d))
    inside = np.mean(np.all(np.abs(nu) <= k, axis=1))
    assert inside == pytest.approx(p, abs=0.004)


@pytest.mark.parametrize("p", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_halfwidth_rejects_bad_p(p: float) -> None:
    with pytest.raises(ValueError, match=r"p must be a finite number in \(0.0, 1.0\)"):
        halfwidth(p, 4)


def test_halfwidth_rejects_bad_dimension() -> None:
    with pytest.raises(ValueError, match="latent_dim"):
        halfwidth(0.9, 0)


def test_support_box_golden_vector() -> None:
    mu = Box(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 1.0]]))
    box = support_box(mu, torch.tensor([[1.0, 0.5]]), 2.0)
    assert torch.allclose(box.lower, torch.tensor([[-2.0, 0.0]]))
    assert torch.allclose(box.upper, torch.tensor([[2.5, 2.0]]))


def test_layer_cake_weights_golden_vector() -> None:
    w = layer_cake_weights([0.5, 0.75, 0.9, 0.95])
    assert torch.allclose(w, torch.tensor([0.5, 0.25, 0.15, 0.05], dtype=torch.float64))


def test_expected_bound_golden_vector() -> None:
    # 0.5*1 + 0.4*2 + 0.1*10 (tail) = 2.3
    bounds = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    out = expected_bound([0.5, 0.9], bounds, 10.0)
    assert out.item() == pytest.approx(2.3)


def test_expected_bound_repairs_non_monotone_levels() -> None:
    # a level bound below the previous one is replaced by the running max: sound
    bounds = torch.tensor([[3.0], [1.0]], dtype=torch.float64)
    out = expected_bound([0.5, 0.9], bounds, 10.0)
    assert out.item() == pytest.approx(0.5 * 3 + 0.4 * 3 + 0.1 * 10)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.floats(0.0, 5.0), min_size=3, max_size=3),
    ceiling=st.floats(5.0, 50.0),
)
def test_expected_bound_lies_between_the_smallest_and_the_ceiling(
    values: list[float], ceiling: float
) -> None:
    bounds = torch.tensor(sorted(values), dtype=torch.float64)[:, None]
    out = expected_bound([0.5, 0.8, 0.95], bounds, ceiling).item()
    assert min(values) - 1e-12 <= out <= ceiling + 1e-12


def test_expected_bound_dominates_the_true_expectation() -> None:
    # loss = |nu| (d=1), capped at 4; the layer-cake bound must exceed E[min(|nu|,4)]
    levels = [0.5, 0.75, 0.9, 0.95, 0.99]
    bounds = torch.tensor([[halfwidth(q, 1)] for q in levels], dtype=torch.float64)
    bound = expected_bound(levels, bounds, 4.0).item()
    nu = np.abs(np.random.default_rng(1).standard_normal(100_000))
    assert bound >= float(np.mean(np.minimum(nu, 4.0)))


@pytest.mark.parametrize(
    ("levels", "match"),
    [
        ((), "empty"),
        ((0.5, 0.5), "increasing"),
        ((0.9, 0.5), "increasing"),
        ((0.5, 1.0), "level"),
    ],
)
def test_check_levels_rejects_bad_levels(levels: tuple[float, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_levels(levels)


def test_exact_halfwidth_without_spread_is_the_uniform_one() -> None:
    k = exact_halfwidths(torch.zeros(3, dtype=torch.float64), 0.95, 4)
    assert torch.allclose(k, torch.full((3,), halfwidth(0.95, 4), dtype=torch.float64))


@settings(max_examples=50, deadline=None)
@given(spread=st.floats(0.0, 20.0), p=st.floats(0.05, 0.999), d=st.integers(1, 16))
def test_exact_halfwidth_reaches_the_mass_and_is_never_wider(
    spread: float, p: float, d: int
) -> None:
    k = exact_halfwidths(torch.tensor([spread], dtype=torch.float64), p, d).item()
    assert 0.0 <= k <= halfwidth(p, d) + 1e-12
    mass = stats.norm.cdf(spread + k) - stats.norm.cdf(-k)
    assert mass >= p ** (1 / d) - 1e-12


def test_exact_halfwidths_reject_negative_spread() -> None:
    with pytest.raises(ValueError, match="spread must be finite and >= 0"):
        exact_halfwidths(torch.tensor([-1.0]), 0.9, 2)
