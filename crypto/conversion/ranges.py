r"""Calibrated ranges of the converted model and the polynomials fitted on them.

A *site* is one approximated input of :class:`~crypto.conversion.model.HEBert`. Its
range is measured on the user's data (exact mode) and widened by a margin:

* a kernel distance :math:`\lVert q-k\rVert^2/(2\sqrt{d_h}) \in [0, D]`, fitted as
  :math:`u \mapsto e^{-D u}` on :math:`u \in [0, 1]`;
* a LayerNorm variance :math:`\sigma^2 \in [v_{lo}, v_{hi}]`, fitted as
  :math:`s \mapsto s^{-1/2}` on :math:`[v_{lo}/v_{hi}, 1]` (``div`` = :math:`v_{hi}`);
* an activation or pooler input :math:`x \in [-B, B]`, fitted as
  :math:`t \mapsto f(B t)` on :math:`[-1, 1]` (ReLU, GELU or tanh).

Inputs are normalised to ``[0, 1]`` or ``[-1, 1]`` before the polynomial, as in
:mod:`crypto.he.approx`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from defenses.arrays import FloatArray

from ..he.approx import chebyshev_fit

LN_FLOOR = 1e-4
"""A LayerNorm range's lower end is at least this fraction of its upper end."""


@dataclass
class BertCalibration:
    """Every site's calibrated raw range and polynomial (normalised input).

    Attributes
    ----------
    ranges : dict
        ``site -> (lo, hi)``: :math:`[0, D]`, :math:`[v_{lo}, v_{hi}]` or
        :math:`[-B, B]`.
    polys : dict
        ``site ->`` monomial coefficients (low to high) on the normalised input.
    calibrated : bool
        Whether :func:`fit_site` has filled every site.
    """

    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    polys: dict[str, FloatArray] = field(default_factory=dict)
    calibrated: bool = False

    def normalised_low(self, site: str) -> float:
        """Lower end of ``site``'s normalised interval (its upper end is 1)."""
        lo, hi = self.ranges[site]
        if "LayerNorm" in site:
            return lo / hi
        return 0.0 if "kernel" in site else -1.0


def tanh(x: FloatArray) -> FloatArray:
    """The pooler's tanh."""
    return np.asarray(np.tanh(x), dtype=np.float64)


def gelu(x: FloatArray) -> FloatArray:
    r""":math:`x\,\Phi(x)`, the exact GELU."""
    from scipy.special import erf

    return np.asarray(0.5 * x * (1.0 + erf(x / math.sqrt(2.0))), dtype=np.float64)


def relu(x: FloatArray) -> FloatArray:
    r""":math:`\max(x, 0)`."""
    return np.maximum(x, 0.0)


def _scaled(
    function: Callable[[FloatArray], FloatArray], top: float
) -> Callable[[FloatArray], FloatArray]:
    def f(x: FloatArray) -> FloatArray:
        return function(top * x)

    return f


def _decay(top: float) -> Callable[[FloatArray], FloatArray]:
    def f(u: FloatArray) -> FloatArray:
        return np.asarray(np.exp(-top * u), dtype=np.float64)

    return f


def _isqrt(s: FloatArray) -> FloatArray:
    return np.asarray(s**-0.5, dtype=np.float64)


def fit_site(
    site: str,
    values: FloatArray,
    margin: float,
    degree: int,
    function: Callable[[FloatArray], FloatArray] | None = None,
) -> tuple[tuple[float, float], FloatArray]:
    """Range (with ``margin``) and polynomial of one site from its raw ``values``.

    ``function`` is the activation a non-kernel, non-LayerNorm site stands for
    (``np.tanh`` for the pooler).
    """
    if not np.all(np.isfinite(values)):
        raise ValueError(f"calibration data give NaN or inf at {site}")
    if "LayerNorm" in site:
        hi = max(float(values.max()) * margin, 1e-12)
        lo = min(max(float(values.min()) / margin, hi * LN_FLOOR), 0.5 * hi)
        return (lo, hi), chebyshev_fit(_isqrt, lo / hi, 1.0, degree)
    if "kernel" in site:
        top = max(float(values.max()) * margin, 1e-3)
        return (0.0, top), chebyshev_fit(_decay(top), 0.0, 1.0, degree)
    if function is None:
        raise ValueError(f"site {site!r} needs the function it approximates")
    top = max(float(np.abs(values).max()) * margin, 1e-3)
    return (-top, top), chebyshev_fit(_scaled(function, top), -1.0, 1.0, degree)
