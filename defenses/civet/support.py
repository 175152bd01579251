r"""Support sets at the latent layer (Xu et al., ICLR 2025, "Support is All You Need").

**Support-set lemma.** If a set :math:`S` satisfies :math:`\Pr_\nu[z \in S] \ge p`
for every admissible input :math:`x'`, then
:math:`U_p = \sup_{z \in S} \ell(D(z), y)` bounds the loss with probability at
least :math:`p`, for every :math:`x'` at once.

**Box support.** With encoder bounds :math:`\mu \in [\mu^l, \mu^u]` and
:math:`\sigma \le \sigma^u` over the input ball, take

.. math::  k = \Phi^{-1}\!\left(\tfrac{1 + p^{1/d}}{2}\right), \qquad
           S_p = \prod_i [\mu^l_i - k\sigma^u_i,\; \mu^u_i + k\sigma^u_i].

If :math:`|\nu_i| \le k` for all :math:`i` then :math:`z \in S_p`, so
:math:`\Pr[z \in S_p] \ge (2\Phi(k) - 1)^d = p`. :math:`S_p` is also the interval
image of the joint box :math:`B \times [-k, k]^d` through
:math:`(x', \nu) \mapsto \mu(x') + \sigma(x') \odot \nu`, which is what the joint
attack searches.

**Exact per-dimension half-widths (optional, tighter).** Given the encoder box,
the mass of :math:`N(\mu_i, \sigma_i^2)` in
:math:`[\mu^l_i - k_i\sigma^u_i, \mu^u_i + k_i\sigma^u_i]` is smallest at
:math:`\sigma_i = \sigma^u_i` and :math:`\mu_i` at an end of its interval, where it is
:math:`\Phi(\Delta_i/\sigma^u_i + k_i) - \Phi(-k_i)` with
:math:`\Delta_i = \mu^u_i - \mu^l_i`; the smallest :math:`k_i` that makes this at
least :math:`p^{1/d}` (bisection) still gives mass :math:`\ge p` for every
:math:`x'`, and :math:`k_i \le k`.

**Expected loss (layer cake).** For nested supports with masses
:math:`p_1 < \dots < p_m`, bounds :math:`U_1 \le \dots \le U_m` and a loss bounded
by :math:`L_{\max}`,

.. math::  \sup_{x'} \mathbb E_\nu[\ell] \le \sum_j (p_j - p_{j-1})\, U_j
           + (1 - p_m) L_{\max}, \qquad p_0 = 0.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch
from scipy import stats

from defenses.checks import check_int, check_real
from defenses.civet.bounds import Box


def dimension_deficit(p: float, latent_dim: int) -> float:
    r"""Mass :math:`1 - p^{1/d}` each latent dimension may leave out.

    Computed as :math:`-\mathrm{expm1}(\log(p) / d)`, which stays exact for ``p``
    within rounding of 1 (where :math:`p^{1/d}` itself rounds to 1).
    """
    return -math.expm1(math.log(p) / latent_dim)


@functools.lru_cache(maxsize=256)
def halfwidth(p: float, latent_dim: int) -> float:
    r"""Per-dimension half-width :math:`k = \Phi^{-1}((1 + p^{1/d}) / 2)`.

    The box :math:`[-k, k]^d` holds mass exactly ``p`` under :math:`N(0, I_d)`.
    It is evaluated as the upper-tail quantile
    :math:`\bar\Phi^{-1}((1 - p^{1/d}) / 2)`, finite for every ``p < 1``.
    """
    level = check_real("p", p, 0.0, 1.0, open_low=True, open_high=True)
    d = check_int("latent_dim", latent_dim, 1)
    return float(stats.norm.isf(dimension_deficit(level, d) / 2.0))


def box_mass(k: float, latent_dim: int) -> float:
    r"""Standard-normal mass of :math:`[-k, k]^d`, :math:`(2\Phi(k) - 1)^d`."""
    if not k >= 0:
        raise ValueError(f"k must be >= 0, got {k!r}")
    return float((2.0 * stats.norm.cdf(k) - 1.0) ** latent_dim)


def support_box(mu: Box, sigma_upper: torch.Tensor, k: float) -> Box:
    r"""The support box :math:`[\mu^l - k\sigma^u, \mu^u + k\sigma^u]`."""
    if not k >= 0:
        raise ValueError(f"k must be >= 0, got {k!r}")
    return Box(mu.lower - k * sigma_upper, mu.upper + k * sigma_upper).validate()


def exact_halfwidths(
    spread: torch.Tensor, p: float, latent_dim: int, iterations: int = 60
) -> torch.Tensor:
    r"""Smallest :math:`k_i` with :math:`\Phi(s_i + k_i) - \Phi(-k_i) \ge p^{1/d}`.

    The test is made on the left-out mass,
    :math:`\Phi(-s_i - k_i) + \Phi(-k_i) \le 1 - p^{1/d}`, exact for ``p`` near 1.

    Parameters
    ----------
    spread : torch.Tensor
        :math:`s_i = \Delta_i / \sigma^u_i \ge 0`, any shape.
    p, latent_dim
        Level and latent dimension :math:`d`.
    iterations : int
        Bisection steps (the result is rounded up, so it stays sound).
    """
    if bool((spread < 0).any()) or not bool(torch.isfinite(spread).all()):
        raise ValueError("spread must be finite and >= 0")
    allowed = dimension_deficit(p, latent_dim)
    low = torch.zeros_like(spread)
    high = torch.full_like(spread, halfwidth(p, latent_dim))

    def missing(k: torch.Tensor) -> torch.Tensor:
        # 1 - (Phi(s + k) - Phi(-k)), in the tails so that it stays exact near 1
        outside: torch.Tensor = torch.special.ndtr(-(spread + k)) + torch.special.ndtr(
            -k
        )
        return outside

    for _ in range(iterations):
        middle = (low + high) / 2
        enough = missing(middle) <= allowed
        high = torch.where(enough, middle, high)
        low = torch.where(enough, low, middle)
    return high


def check_levels(levels: Sequence[float]) -> tuple[float, ...]:
    """Validate nested support levels: strictly increasing, each in (0, 1)."""
    out = tuple(
        check_real("levels", q, 0.0, 1.0, open_low=True, open_high=True) for q in levels
    )
    if not out:
        raise ValueError("levels must not be empty")
    if any(b <= a for a, b in itertools.pairwise(out)):
        raise ValueError(f"levels must be strictly increasing, got {list(levels)!r}")
    return out


def layer_cake_weights(levels: Sequence[float]) -> torch.Tensor:
    """Weights :math:`p_j - p_{j-1}` of the nested-support expected-loss bound."""
    q = torch.tensor((0.0, *check_levels(levels)), dtype=torch.float64)
    return q[1:] - q[:-1]


def expected_bound(
    levels: Sequence[float], bounds: torch.Tensor, l_max: torch.Tensor | float
) -> torch.Tensor:
    r"""Certified bound on the worst-case expected loss from nested supports.

    Parameters
    ----------
    levels : sequence of float
        Masses :math:`p_1 < \dots < p_m` of the nested supports.
    bounds : torch.Tensor of shape (m, n)
        :math:`U_j` per level and input (non-decreasing in ``j``; a running max
        is taken, which keeps the bound sound).
    l_max : float or tensor of shape (n,)
        Largest value the loss can take.
    """
    weights = layer_cake_weights(levels).to(bounds.dtype)
    if bounds.ndim != 2 or bounds.shape[0] != weights.shape[0]:
        raise ValueError(
            f"bounds must have shape ({weights.shape[0]}, n), got {tuple(bounds.shape)}"
        )
    monotone = torch.cummax(bounds, dim=0).values
    limit = torch.as_tensor(l_max, dtype=bounds.dtype)
    capped = torch.minimum(monotone, limit)
    tail = 1.0 - float(levels[-1])
    return (weights[:, None] * capped).sum(dim=0) + tail * limit
