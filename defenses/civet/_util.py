"""Input checks shared by the CIVET modules: eps, p and the input batch."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch


def check_eps(eps: float) -> float:
    """Return ``eps`` as a float; raise if it is not a finite number >= 0."""
    if isinstance(eps, bool) or not isinstance(eps, int | float | np.floating):
        raise TypeError(f"eps must be a number, got {eps!r}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return float(eps)


def check_probability(p: float, name: str = "p") -> float:
    """Return ``p`` as a float; raise unless it lies strictly between 0 and 1."""
    if isinstance(p, bool) or not isinstance(p, int | float | np.floating):
        raise TypeError(f"{name} must be a number, got {p!r}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"{name} must lie in the open interval (0, 1), got {p!r}")
    return float(p)


def as_inputs(
    x: torch.Tensor | npt.ArrayLike,
    n_features: int,
    domain: tuple[float, float],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Validate a batch of flat inputs and return it as a detached tensor.

    Raises
    ------
    ValueError
        If ``x`` is not of shape ``(n, n_features)`` with ``n >= 1``, holds NaN or
        inf, or leaves the input domain ``[domain[0], domain[1]]``.
    """
    t = (x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))).detach()
    t = t.to(dtype)
    if t.ndim != 2 or t.shape[1] != n_features or t.shape[0] == 0:
        raise ValueError(
            f"inputs must have shape (n, {n_features}) with n >= 1, "
            f"got {tuple(t.shape)}"
        )
    if not bool(torch.isfinite(t).all()):
        raise ValueError("inputs hold NaN or inf values")
    low, high = domain
    below, above = float(t.min()), float(t.max())
    if below < low or above > high:
        raise ValueError(
            f"inputs must lie in the input domain [{low}, {high}], "
            f"got values in [{below:.6g}, {above:.6g}]"
        )
    return t
