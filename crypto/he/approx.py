r"""Polynomial approximations with calibrated input ranges.

Every non-linearity of the HE-friendly transformer (Rho et al., ICLR 2025, Sec. 4) is
evaluated as a polynomial on an interval that is known in advance:

* the Gaussian kernel :math:`e^{-D u}` on :math:`u \\in [0, 1]` (the squared distance
  divided by its calibrated bound :math:`D`);
* the LayerNorm inverse square root :math:`s^{-1/2}` on :math:`s \\in [a, 1]`,
  refined by Newton steps :math:`y \\leftarrow y (3 - s y^2) / 2`;
* the pooler :math:`\\tanh(B t)` on :math:`t \\in [-1, 1]`;
* the softmax baseline's :math:`e^{x}` and reciprocal.

Fits interpolate at Chebyshev nodes of the first kind and are converted to monomial
coefficients (low to high), the form TenSEAL's ``polyval`` takes. Inputs are always
mapped to ``[0, 1]`` or ``[-1, 1]`` first: a degree-7 monomial form evaluated on values
near 20 loses precision under CKKS (research note, Sec. 3.3).

A :class:`RangeGuard` fails loudly when a value leaves its interval, since a polynomial
diverges outside the range it was fitted on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_int, check_real

TANH_GAIN = 2.0
"""The pooler computes :math:`\\tanh(\\text{TANH\\_GAIN}\\cdot t)` on t in [-1, 1]."""


class RangeError(ValueError):
    """A value left the interval its polynomial approximation was fitted on."""


def depth_of(degree: int) -> int:
    r"""Multiplicative depth TenSEAL's ``polyval`` uses for a degree-``degree`` poly.

    Measured on TenSEAL 0.3.18: :math:`\\lceil \\log_2(\\text{degree} + 1) \\rceil`
    levels (coefficient scaling included).
    """
    if degree < 1:
        raise ValueError(f"degree must be >= 1, got {degree!r}")
    return math.ceil(math.log2(degree + 1))


def chebyshev_fit(
    function: Callable[[FloatArray], FloatArray], lo: float, hi: float, degree: int
) -> FloatArray:
    r"""Monomial coefficients (low to high) interpolating ``function`` on [lo, hi].

    The interpolant matches ``function`` at the ``degree + 1`` Chebyshev nodes
    :math:`x_k = \\tfrac{lo+hi}{2} + \\tfrac{hi-lo}{2}\\cos\\tfrac{(2k+1)\\pi}{2(n+1)}`,
    which is within a factor :math:`2 + \\tfrac{2}{\\pi}\\log(n+1)` of the best
    uniform approximation.
    """
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"need finite lo < hi, got lo={lo!r}, hi={hi!r}")
    check_int("degree", degree, 1)
    k = np.arange(degree + 1)
    nodes = 0.5 * (lo + hi) + 0.5 * (hi - lo) * np.cos(
        (2 * k + 1) * np.pi / (2 * (degree + 1))
    )
    values = np.asarray(function(nodes), dtype=np.float64)
    cheb = np.polynomial.chebyshev.Chebyshev.fit(nodes, values, degree, domain=[lo, hi])
    mono = cheb.convert(kind=np.polynomial.Polynomial, domain=[-1, 1], window=[-1, 1])
    coefficients = np.zeros(degree + 1)
    coefficients[: mono.coef.size] = mono.coef
    return coefficients


def polyval(coefficients: FloatArray, x: FloatArray) -> FloatArray:
    """Evaluate the monomial polynomial (low to high coefficients) at ``x``."""
    return np.asarray(
        np.polynomial.polynomial.polyval(x, coefficients), dtype=np.float64
    )


def max_error(
    function: Callable[[FloatArray], FloatArray],
    coefficients: FloatArray,
    lo: float,
    hi: float,
    points: int = 2001,
) -> float:
    """Largest absolute error of the polynomial on a fine grid of [lo, hi]."""
    grid = np.linspace(lo, hi, points)
    return float(np.max(np.abs(polyval(coefficients, grid) - function(grid))))


@dataclass(frozen=True)
class RangeGuard:
    """Check that values stay inside ``[lo, hi]`` (with a relative ``slack``).

    Parameters
    ----------
    name : str
        What the values are (shown in the error).
    lo, hi : float
        The interval the approximation was fitted on.
    slack : float
        Tolerance as a fraction of ``hi - lo``, >= 0 (CKKS noise must not trip it).
    """

    name: str
    lo: float
    hi: float
    slack: float = 1e-6

    def __post_init__(self) -> None:
        if not (
            math.isfinite(self.lo) and math.isfinite(self.hi) and self.lo < self.hi
        ):
            raise ValueError(
                f"RangeGuard {self.name!r} needs finite lo < hi, "
                f"got {self.lo!r}, {self.hi!r}"
            )
        if not (math.isfinite(self.slack) and self.slack >= 0):
            raise ValueError(f"RangeGuard.slack must be >= 0, got {self.slack!r}")

    def __call__(self, values: npt.ArrayLike) -> None:
        """Raise :class:`RangeError` if any value is NaN or outside the interval."""
        v = np.asarray(values, dtype=np.float64)
        if v.size == 0:
            return
        if not np.all(np.isfinite(v)):
            raise RangeError(f"{self.name}: NaN or inf values")
        tol = self.slack * (self.hi - self.lo)
        low, high = float(v.min()), float(v.max())
        if low < self.lo - tol or high > self.hi + tol:
            raise RangeError(
                f"{self.name}: values span [{low:.4g}, {high:.4g}], outside the "
                f"calibrated range [{self.lo:.4g}, {self.hi:.4g}] of its polynomial; "
                "recalibrate the model or keep inputs in the training distribution"
            )


@dataclass(frozen=True)
class PolyApprox:
    """A polynomial fitted to a function on an interval.

    Parameters
    ----------
    coefficients : ndarray
        Monomial coefficients, low to high.
    lo, hi : float
        The fitted interval.
    """

    coefficients: FloatArray
    lo: float
    hi: float

    @property
    def degree(self) -> int:
        """Polynomial degree."""
        return int(self.coefficients.size - 1)

    @property
    def depth(self) -> int:
        """CKKS levels consumed by ``polyval``."""
        return depth_of(self.degree)


def gaussian_kernel_poly(bound: float, degree: int = 7) -> PolyApprox:
    r"""Fit :math:`u \\mapsto e^{-\\text{bound}\\cdot u}` on :math:`u \\in [0, 1]`.

    With :math:`u = \\lVert q - k\\rVert^2 / (2\\sqrt{d_h}\\,\\text{bound})` this is the
    Gaussian-kernel attention score of Rho et al. (2025), Eq. (GK).
    """
    check_real("bound", bound, 0.0, open_low=True)
    return PolyApprox(
        chebyshev_fit(lambda u: np.exp(-bound * u), 0.0, 1.0, degree), 0.0, 1.0
    )


def inverse_sqrt_poly(lo: float, degree: int = 3) -> PolyApprox:
    r"""Fit :math:`s \\mapsto s^{-1/2}` on :math:`[lo, 1]` (Newton steps follow)."""
    check_real("lo", lo, 0.0, 1.0, open_low=True, open_high=True)
    return PolyApprox(chebyshev_fit(lambda s: s**-0.5, lo, 1.0, degree), lo, 1.0)


def tanh_poly(bound: float, degree: int = 3) -> PolyApprox:
    r"""Fit :math:`\\tanh(\\text{bound}\\cdot t)` on :math:`t \\in [-1, 1]`."""
    check_real("bound", bound, 0.0, open_low=True)
    return PolyApprox(
        chebyshev_fit(lambda t: np.tanh(bound * t), -1.0, 1.0, degree), -1.0, 1.0
    )


def exp_poly(bound: float, degree: int = 7) -> PolyApprox:
    r"""Fit :math:`e^{\\text{bound}\\cdot t}` on :math:`t \\in [-1, 1]` (softmax)."""
    check_real("bound", bound, 0.0, open_low=True)
    return PolyApprox(
        chebyshev_fit(lambda t: np.exp(bound * t), -1.0, 1.0, degree), -1.0, 1.0
    )


def reciprocal_poly(lo: float, degree: int = 3) -> PolyApprox:
    r"""Fit :math:`s \\mapsto 1/s` on :math:`[lo, 1]` (Newton steps follow)."""
    check_real("lo", lo, 0.0, 1.0, open_low=True, open_high=True)
    return PolyApprox(chebyshev_fit(lambda s: 1.0 / s, lo, 1.0, degree), lo, 1.0)


class Degrees(Protocol):
    """The polynomial degrees a model's configuration gives."""

    @property
    def gk_degree(self) -> int:
        """Degree of the kernel fit."""

    @property
    def isqrt_degree(self) -> int:
        """Degree of the inverse square root fit."""

    @property
    def tanh_degree(self) -> int:
        """Degree of the pooler fit."""


@dataclass
class LayerRanges:
    r"""One block's calibrated ranges (with a safety margin).

    Attributes
    ----------
    dist_bound : float
        Upper bound :math:`D` of :math:`\\lVert q-k\\rVert^2 / (2\\sqrt{d_h})`.
    ln_div : float
        Divisor making the LayerNorm variance :math:`\\le 1`.
    ln_lo : float
        Lower end of :math:`\\sigma^2/\\text{div}` for the inverse square root.
    ffn_bound : float
        Bound on :math:`|u W_1|` (the polynomial activation's input).
    polys : dict
        The block's kernel ``"gk"`` and inverse square root ``"isqrt"`` fits.
    """

    dist_bound: float = 8.0
    ln_div: float = 4.0
    ln_lo: float = 0.02
    ffn_bound: float = 8.0
    polys: dict[str, PolyApprox] = field(default_factory=dict)


@dataclass
class Calibration:
    r"""Ranges measured on training data, one :class:`LayerRanges` per block.

    ``dist_bound``, ``ln_div``, ``ln_lo`` and ``ffn_bound`` name block 0's ranges
    (the only block when ``n_layers == 1``); ``polys`` holds block 0's kernel and
    inverse square root and the pooler's ``"tanh"``.

    Attributes
    ----------
    pool_bound : float
        Divisor :math:`B_p` mapping the pooler input into [-1, 1].
    layers : list of LayerRanges
        Every block's ranges, first to last.
    """

    pool_bound: float = 4.0
    calibrated: bool = False
    polys: dict[str, PolyApprox] = field(default_factory=dict)
    layers: list[LayerRanges] = field(default_factory=lambda: [LayerRanges()])

    @property
    def dist_bound(self) -> float:
        """Block 0's kernel distance bound."""
        return self.layers[0].dist_bound

    @property
    def ln_div(self) -> float:
        """Block 0's LayerNorm divisor."""
        return self.layers[0].ln_div

    @property
    def ln_lo(self) -> float:
        """Block 0's lower end of the inverse square root's interval."""
        return self.layers[0].ln_lo

    @property
    def ffn_bound(self) -> float:
        """Block 0's activation-input bound."""
        return self.layers[0].ffn_bound

    def fit_polys(self, config: Degrees) -> None:
        """(Re)fit every block's polynomials to the stored ranges.

        ``config`` gives ``gk_degree``, ``isqrt_degree`` and ``tanh_degree`` (a
        :class:`~crypto.models.heformer.ModelConfig`).
        """
        for ranges in self.layers:
            ranges.polys = {
                "gk": gaussian_kernel_poly(ranges.dist_bound, config.gk_degree),
                "isqrt": inverse_sqrt_poly(ranges.ln_lo, config.isqrt_degree),
            }
        self.polys = {
            **self.layers[0].polys,
            "tanh": tanh_poly(TANH_GAIN, config.tanh_degree),
        }
