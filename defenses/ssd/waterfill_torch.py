r"""The water-filling projection on torch tensors (the paper's GPU algorithm, Alg. 3).

The torch branch of :func:`~defenses.ssd.waterfill.water_filling`, kept apart so
that importing the numpy path does not import torch. Per row, after one sort of the
ratios :math:`r_i = f_i / q_i` and prefix sums of the sorted :math:`f` and :math:`q`,
dense masks find the first breakpoint where raising the coordinates below the level
:math:`w_A` would spend more than :math:`B/2`, and the first where lowering those
above :math:`w_B` spends at most :math:`B/2`; the levels are then the closed form on
that active set and :math:`p^\star_i = \min(\max(f_i, w_A q_i), w_B q_i)`, or
:math:`q` when :math:`w_A \ge 1` (the ball contains :math:`q`). Computed in float64
on the input's device, returned in the dtype of ``f``.
"""

from __future__ import annotations

import numpy.typing as npt
import torch

__all__ = ["water_filling_torch"]


def _check_torch(name: str, values: torch.Tensor, tolerance: float) -> None:
    if not torch.all(torch.isfinite(values)):
        raise ValueError(f"{name} contains NaN or inf")
    if values.numel() and float(values.min()) < 0:
        raise ValueError(f"{name} has negative entries (min {float(values.min()):.3g})")
    error = (values.sum(1) - 1.0).abs()
    if error.numel() and float(error.max()) > tolerance:
        worst = int(error.argmax())
        raise ValueError(
            f"{name} rows must sum to 1 (within {tolerance:.1e}); row {worst} "
            "sums "
            f"to {float(values[worst].sum())!r}"
        )


def _prepare_torch(
    f: torch.Tensor,
    q: torch.Tensor,
    budget: torch.Tensor | npt.ArrayLike,
    tol: float,
    floor: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not (torch.is_floating_point(f) and torch.is_floating_point(q)):
        raise ValueError(f"f and q must be floating-point, got {f.dtype} and {q.dtype}")
    if f.ndim != 2 or f.shape != q.shape or f.shape[1] == 0:
        raise ValueError(
            f"f and q must have the same shape (N, K) with K >= 1, got "
            f"{tuple(f.shape)} and {tuple(q.shape)}"
        )
    f64 = f.detach().to(torch.float64)
    q64 = q.detach().to(device=f.device, dtype=torch.float64)
    _check_torch("f", f64, tol)
    _check_torch("q", q64, tol)
    b_in = torch.as_tensor(budget)
    if b_in.is_complex():
        raise ValueError(f"budget must be real numbers, got {b_in.dtype}")
    b64 = b_in.to(device=f.device, dtype=torch.float64)
    if b64.shape != (f.shape[0],):
        raise ValueError(
            f"budget must have shape ({f.shape[0]},), got {tuple(b64.shape)}"
        )
    if not torch.all(torch.isfinite(b64)):
        raise ValueError("budget contains NaN or inf")
    if b64.numel() and float(b64.min()) < 0:
        raise ValueError(f"budget must be >= 0, got min {float(b64.min())!r}")
    if q64.numel() and float(q64.min()) < floor:
        q64 = q64.clamp(min=floor)
        q64 = q64 / q64.sum(1, keepdim=True)
    return f64, q64, b64


def _water_filling_torch(
    f: torch.Tensor, q: torch.Tensor, budget: torch.Tensor
) -> torch.Tensor:
    n, k = f.shape
    if k == 1 or n == 0:
        return q.clone()
    half = (0.5 * budget)[:, None]
    ratio, order = torch.sort(f / q, dim=1)
    fs = torch.gather(f, 1, order)
    qs = torch.gather(q, 1, order)
    fp, qp = fs.cumsum(1), qs.cumsum(1)
    qs_suffix = qs.flip(1).cumsum(1).flip(1)
    total = fp[:, -1:]
    ones = torch.ones((n, 1), dtype=torch.bool, device=f.device)
    raise_fails = torch.cat([ratio[:, 1:] * qp[:, :-1] - fp[:, :-1] > half, ones], 1)
    j_a = raise_fails.int().argmax(1, keepdim=True)
    lower_ok = torch.cat(
        [(total - fp[:, :-1]) - ratio[:, :-1] * qs_suffix[:, 1:] <= half, ones], 1
    )
    j_b = lower_ok.int().argmax(1, keepdim=True)
    w_a = (fp.gather(1, j_a) + half) / qp.gather(1, j_a)
    before = (j_b - 1).clamp(min=0)
    above_f = torch.where(j_b > 0, total - fp.gather(1, before), total)
    w_b = (above_f - half) / qs_suffix.gather(1, j_b)
    clipped = torch.minimum(torch.maximum(f, w_a * q), w_b * q)
    trivial = w_a >= 1.0
    return torch.where(trivial, q, clipped)


def water_filling_torch(
    f: torch.Tensor,
    q: torch.Tensor,
    budget: torch.Tensor | npt.ArrayLike,
    tolerance: float,
    floor: float,
) -> torch.Tensor:
    """Check the inputs (rows summing to one within ``tolerance``), then project.

    Entries of ``q`` below ``floor`` are raised to it and the rows renormalised, as
    in the numpy path.
    """
    ft, qt, bt = _prepare_torch(f, q, budget, tolerance, floor)
    return _water_filling_torch(ft, qt, bt).to(f.dtype)
