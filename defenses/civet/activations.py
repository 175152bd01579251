r"""Interval rules of the activations that are not monotone on every box.

*Unimodal activations* fall, then rise, around their minimiser :math:`x^\ast`: SiLU
:math:`x\,\sigma(x)` (:math:`x^\ast \approx -1.2785`), GELU :math:`x\,\Phi(x)`
(:math:`x^\ast \approx -0.7518`, and the tanh approximation), LeakyReLU with a
negative slope and ELU with a negative alpha (:math:`x^\ast = 0`). Over
:math:`[l, u]` the maximum is :math:`\max(g(l), g(u))` and the minimum is
:math:`g(x^\ast)` if :math:`l \le x^\ast \le u`, else :math:`\min(g(l), g(u))`
(:func:`unimodal`; the minimum value is lowered by a relative :math:`10^{-12}` so
that the library's rounding at :math:`x^\ast` stays inside).

*Softplus with a threshold* (``nn.Softplus(beta, threshold)``, ``F.softplus``) is

.. math::  f(x) = x \text{ if } \beta x > t, \quad
           g(x) = \log(1 + e^{\beta x}) / \beta \text{ otherwise}.

Both pieces increase (for either sign of :math:`\beta`), but :math:`f` jumps down
by :math:`\log(1 + e^{-t}) / |\beta|` where :math:`\beta x` crosses :math:`t` (from
:math:`\log 2` to 0 at :math:`t = 0`): it is not monotone. :func:`softplus` takes
:math:`[f(l), f(u)]` on a box inside one piece, and on a box that reaches the
switch point :math:`x_0 = t/\beta` it adds the values at the jump: for
:math:`\beta > 0` (smooth piece left of :math:`x_0`) the range is inside
:math:`[\min(f(l), \max(l, x_0)), \max(f(u), J)]`, for :math:`\beta < 0` (linear
piece left) inside :math:`[\min(f(l), J), \max(f(u), \min(u, x_0))]`, with
:math:`J = \log(1 + e^{t})/\beta` the smooth piece's value at the switch. The
switch test is widened by :math:`10^{-6}(|t| + 1)` in :math:`\beta x` and
:math:`x_0`, :math:`J` are moved outwards by a relative :math:`10^{-6}`, so a
model that takes the switch in float32 (where :math:`\beta x` rounds differently)
stays inside too. :math:`\beta = 0` or a non-finite parameter is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from scipy import optimize, special

from defenses.civet.box import Box, UnsupportedLayerError, monotone


def unimodal(
    box: Box,
    fn: Callable[[torch.Tensor], torch.Tensor],
    argmin: float,
    minimum: float,
) -> Box:
    r"""Exact image of ``box`` under an elementwise map falling then rising.

    ``fn`` decreases on :math:`(-\infty, x^\ast]` and increases on
    :math:`[x^\ast, \infty)`, with :math:`x^\ast` = ``argmin`` and
    :math:`g(x^\ast)` = ``minimum``.
    """
    low, high = fn(box.lower), fn(box.upper)
    inside = (box.lower <= argmin) & (box.upper >= argmin)
    bottom = torch.full_like(low, minimum - 1e-12 * abs(minimum))
    floor = torch.where(inside, bottom, torch.minimum(low, high))
    return Box(floor, torch.maximum(low, high))


def _stationary(
    derivative: Callable[[float], float], value: Callable[[float], float]
) -> tuple[float, float]:
    """The minimiser on [-3, -0.1] (a root of the derivative) and the minimum."""
    point = float(optimize.brentq(derivative, -3.0, -0.1, xtol=1e-15, rtol=1e-15))
    return point, float(value(point))


def _silu_slope(x: float) -> float:
    s = float(special.expit(x))
    return s * (1.0 + x * (1.0 - s))


def _gelu_slope(x: float) -> float:
    return float(special.ndtr(x)) + x * math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


_C, _A = math.sqrt(2.0 / math.pi), 0.044715


def _gelu_tanh(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(_C * (x + _A * x**3)))


def _gelu_tanh_slope(x: float) -> float:
    t = math.tanh(_C * (x + _A * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3.0 * _A * x * x)


SILU_MIN = _stationary(_silu_slope, lambda x: x * float(special.expit(x)))
GELU_MIN = {
    "none": _stationary(_gelu_slope, lambda x: x * float(special.ndtr(x))),
    "tanh": _stationary(_gelu_tanh_slope, _gelu_tanh),
}

SWITCH_MARGIN = 1e-6
"""Relative widening of the softplus switch test and of its jump values."""


def softplus(box: Box, beta: float = 1.0, threshold: float = 20.0) -> Box:
    """Sound image of ``box`` under ``F.softplus(x, beta, threshold)`` (see above)."""
    beta, threshold = float(beta), float(threshold)
    if beta == 0.0 or not (math.isfinite(beta) and math.isfinite(threshold)):
        raise UnsupportedLayerError(
            f"softplus with beta={beta!r}, threshold={threshold!r}: beta must be "
            "finite and non-zero and the threshold finite"
        )
    low = F.softplus(box.lower, beta, threshold)
    high = F.softplus(box.upper, beta, threshold)
    ends = (box.lower * beta, box.upper * beta)
    s_low, s_high = ends if beta > 0 else ends[::-1]
    margin = SWITCH_MARGIN * (abs(threshold) + 1.0)
    near = (s_low <= threshold + margin) & (s_high > threshold - margin)
    if not bool(near.any()):
        return Box(low, high)
    t = torch.tensor(threshold, dtype=box.lower.dtype)
    jump = torch.log1p(torch.exp(t)) / beta  # the smooth piece at the switch
    jump = jump + SWITCH_MARGIN * jump.abs() * (1.0 if beta > 0 else -1.0)
    switch = threshold / beta
    slack = SWITCH_MARGIN * abs(switch) + 1e-30
    if beta > 0:
        floor = torch.minimum(low, box.lower.clamp(min=switch - slack))
        ceiling = torch.maximum(high, jump)
    else:
        floor = torch.minimum(low, jump)
        ceiling = torch.maximum(high, box.upper.clamp(max=switch + slack))
    return Box(torch.where(near, floor, low), torch.where(near, ceiling, high))


def sloped(
    fn: Callable[[torch.Tensor, float], torch.Tensor], slope: float
) -> Callable[[Box], Box]:
    """LeakyReLU / ELU: monotone for a slope >= 0, else unimodal around 0."""
    if not math.isfinite(slope):
        raise UnsupportedLayerError(f"negative slope / alpha {slope!r} is not finite")
    if slope >= 0:
        return lambda box: monotone(box, lambda t: fn(t, slope))
    return lambda box: unimodal(box, lambda t: fn(t, slope), 0.0, 0.0)
