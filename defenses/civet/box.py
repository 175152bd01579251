r"""The box domain of interval bound propagation, and its three generic rules.

A box :math:`[l, u]` of a batch of tensors is carried by its two ends; its centre
is :math:`c = (u + l)/2` and its radius :math:`r = (u - l)/2`. The generic rules:

* a map non-decreasing in every input, :math:`g`, sends the box to
  :math:`[g(l), g(u)]` (:func:`monotone`);
* a map linear in its input, :math:`f(x) = Wx + b`, sends it into
  :math:`[Wc + b - |W| r,\; Wc + b + |W| r]` (:func:`affine`; Gowal et al., "On the
  effectiveness of interval bound propagation", 2018);
* an elementwise :math:`s \odot x + t` with :math:`s` of any sign sends it to
  :math:`[\min(sl, su) + t, \max(sl, su) + t]` (:func:`scale_shift`).

The layer rules (:mod:`defenses.civet.bounds`), the activation rules
(:mod:`defenses.civet.activations`) and the tensor-function rules
(:mod:`defenses.civet.operations`) are built from these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class UnsupportedLayerError(TypeError):
    """Bound propagation met a layer it has no sound rule for."""


@dataclass(frozen=True)
class Box:
    """An axis-aligned box ``[lower, upper]`` of a batch of tensors.

    Parameters
    ----------
    lower, upper : torch.Tensor
        Same shape, ``lower <= upper`` elementwise, no NaN (checked by
        :meth:`validate`, which :func:`ibp` calls once on its input box; the
        boxes built inside the propagation are sound by construction).
    """

    lower: torch.Tensor
    upper: torch.Tensor

    def validate(self) -> Box:
        """Return ``self`` after checking dtypes, shapes, finiteness and order.

        Raises
        ------
        TypeError
            If the bounds are not floating-point tensors of one dtype.
        ValueError
            If the bounds differ in shape, hold NaN or inf, or cross.
        """
        if self.lower.shape != self.upper.shape:
            raise ValueError(
                f"Box bounds must have the same shape, got {tuple(self.lower.shape)} "
                f"and {tuple(self.upper.shape)}"
            )
        for end in (self.lower, self.upper):
            if not isinstance(end, torch.Tensor) or not end.is_floating_point():
                raise TypeError(
                    "Box bounds must be floating-point tensors, got "
                    f"{getattr(end, 'dtype', type(end).__name__)}"
                )
        if self.lower.dtype != self.upper.dtype:
            raise TypeError(
                f"Box bounds must share a dtype, got {self.lower.dtype} and "
                f"{self.upper.dtype}"
            )
        if not bool(
            torch.isfinite(self.lower).all() & torch.isfinite(self.upper).all()
        ):
            raise ValueError("Box bounds hold NaN or inf")
        if bool((self.lower > self.upper).any()):
            gap = float((self.lower - self.upper).max())
            raise ValueError(f"Box needs lower <= upper; lower exceeds upper by {gap}")
        return self

    @classmethod
    def linf_ball(
        cls, x: torch.Tensor, eps: float, domain: tuple[float, float] | None = None
    ) -> Box:
        """The L-infinity ball of radius ``eps`` around ``x``, cut to ``domain``."""
        lower, upper = x - eps, x + eps
        if domain is not None:
            lower, upper = lower.clamp(*domain), upper.clamp(*domain)
        return cls(lower, upper)

    @property
    def center(self) -> torch.Tensor:
        """Midpoint ``(upper + lower) / 2``."""
        return (self.upper + self.lower) / 2

    @property
    def radius(self) -> torch.Tensor:
        """Half-width ``(upper - lower) / 2``."""
        return (self.upper - self.lower) / 2

    def contains(self, x: torch.Tensor, tol: float = 0.0) -> torch.Tensor:
        """Per-row flag: every coordinate of ``x`` lies in the box, up to ``tol``."""
        inside = (x >= self.lower - tol) & (x <= self.upper + tol)
        return inside.reshape(inside.shape[0], -1).all(dim=1)


Rule = Callable[[Box], Box]


def monotone(box: Box, fn: Callable[[torch.Tensor], torch.Tensor]) -> Box:
    """Image of ``box`` under a map that is non-decreasing in every input."""
    return Box(fn(box.lower), fn(box.upper))


def affine(
    box: Box,
    apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> Box:
    """Image of ``box`` under ``x -> apply(x, weight, bias)``, linear in ``x``.

    Centre :math:`Wc + b`, radius :math:`|W| r`.
    """
    center = apply(box.center, weight, bias)
    radius = apply(box.radius, weight.abs(), None)
    return Box(center - radius, center + radius)


def scale_shift(box: Box, scale: torch.Tensor, shift: torch.Tensor | float) -> Box:
    """Image of ``box`` under the elementwise map ``scale * x + shift`` (any sign)."""
    a, b = box.lower * scale, box.upper * scale
    return Box(torch.minimum(a, b) + shift, torch.maximum(a, b) + shift)
