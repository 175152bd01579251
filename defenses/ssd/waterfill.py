r"""Closed-form KL projection onto an L1 ball around a distribution (water-filling).

For each row, with :math:`f, q \in \Delta_K` and a budget :math:`B \ge 0`, solve

.. math::

    p^\star = \arg\min_{p \in \Delta_K} \mathrm{KL}(p \,\|\, q)
    \quad \text{s.t.} \quad \lVert p - f \rVert_1 \le B,

problem (6) of Zhuang et al., *Stealthy Shield Defense: A Conditional Mutual
Information-Based Approach against Black-Box Model Inversion Attacks*, ICLR 2025,
solved in closed form as in their Appendix B:

* if :math:`\lVert q - f \rVert_1 \le B` then :math:`p^\star = q` (the trivial case);
* otherwise the budget is spent exactly, half raising the coordinates where
  :math:`q_i > f_i` and half lowering the others, and

  .. math::

      p^\star_i = \min\bigl(\max(f_i, w_A q_i),\; w_B q_i\bigr), \qquad
      \sum_i (w_A q_i - f_i)_+ = \tfrac B2, \qquad
      \sum_i (f_i - w_B q_i)_+ = \tfrac B2,

  with :math:`0 < w_A < 1 < w_B`. Both sums are piecewise linear in the level
  :math:`w` with breakpoints at the ratios :math:`r_i = f_i / q_i`, so one sort of the
  ratios and prefix sums give both levels: :math:`O(K \log K)` per row.

The numpy version sorts the ratios once per row (the column index rides in the
lowest mantissa bits of the ratio, so one float sort yields the permutation), builds
prefix sums of :math:`f` and :math:`q` and a suffix sum of :math:`q` in ratio order, and
locates each level by a vectorized binary search over the breakpoints. There is no
Python loop over rows. The torch version follows the paper's GPU algorithm (Alg. 3)
with dense masks. Both compute in float64 and return the input's dtype.

Entries of ``q`` below ``floor`` are raised to ``floor`` and the rows renormalised
(in effect: the levels absorb the row's new mass, see ``_floored``):
:math:`\mathrm{KL}(p \| q)` is infinite wherever :math:`q_i = 0 < p_i`, so a zero
(e.g. a float32 underflow) would make the problem infeasible for small budgets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, overload

import numpy as np
import numpy.typing as npt
import torch

FloatArray = npt.NDArray[np.float64]

FLOOR = 1e-12
"""Smallest entry of ``q`` used in the projection (zeros are raised to it)."""

_MAX_COLUMNS = 1 << 20


def sum_tolerance(dtype: np.dtype[np.floating] | torch.dtype, n_classes: int) -> float:
    """Tolerance on ``|sum(row) - 1|`` for probability rows of a given dtype.

    float64 rows must sum to one within ``1e-6``; lower precisions within
    ``1e-6 + 8 * eps * K`` (a float32 softmax over 1000 classes sums to one only to
    about ``1e-5``).
    """
    eps = (
        torch.finfo(dtype).eps
        if isinstance(dtype, torch.dtype)
        else np.finfo(dtype).eps
    )
    if eps < 1e-15:
        return 1e-6
    return float(1e-6 + 8.0 * eps * n_classes)


def _row_sums(values: FloatArray) -> FloatArray:
    """Row sums of a 2-D array as a matrix-vector product.

    ``values.sum(axis=1)`` reduces row by row, which costs far more than the
    arithmetic for short rows (K = 10); a BLAS ``gemv`` with a vector of ones does not.
    """
    sums: FloatArray = values @ np.ones(values.shape[1], dtype=values.dtype)
    return sums


class RowSummary(NamedTuple):
    """What :func:`check_probabilities` computed on the way: row sums, least entry."""

    sums: FloatArray
    smallest: float


def check_probabilities(
    name: str, values: FloatArray, tolerance: float, first_row: int = 0
) -> RowSummary:
    """Raise ValueError unless ``values`` has finite, non-negative rows summing to 1.

    Parameters
    ----------
    name : str
        What the array is called in the error message.
    values : ndarray of shape (N, K)
        The rows to check.
    tolerance : float
        Largest allowed ``|sum(row) - 1|``.
    first_row : int
        Index of the first row of ``values`` in the caller's array (for messages).

    Returns
    -------
    RowSummary
        The row sums and the smallest entry (reused by the floor of ``q``).
    """
    if values.ndim != 2 or values.shape[1] == 0:
        raise ValueError(
            f"{name} must have shape (N, K) with K >= 1, got {values.shape}"
        )
    if values.size == 0:
        return RowSummary(np.zeros(values.shape[0]), 0.0)
    sums = _row_sums(values)
    if not np.isfinite(sums).all():
        raise ValueError(f"{name} contains NaN or inf")
    smallest = float(values.min())
    if smallest < 0:
        raise ValueError(f"{name} has negative entries (min {smallest:.3g})")
    worst = int(np.argmax(np.abs(sums - 1.0)))
    if abs(sums[worst] - 1.0) > tolerance:
        raise ValueError(
            f"{name} rows must sum to 1 (within {tolerance:.1e}); "
            f"row {first_row + worst} sums "
            f"to {sums[worst]!r}"
        )
    return RowSummary(sums, smallest)


def _check_budget(budget: FloatArray, n: int) -> None:
    if budget.shape != (n,):
        raise ValueError(f"budget must have shape ({n},), got {budget.shape}")
    if not np.all(np.isfinite(budget)):
        raise ValueError("budget contains NaN or inf")
    if budget.size and budget.min() < 0:
        raise ValueError(f"budget must be >= 0, got min {budget.min()!r}")


def _floored(q: FloatArray, summary: RowSummary) -> tuple[FloatArray, FloatArray]:
    r"""Raise entries below :data:`FLOOR`; return them with the new row masses.

    ``summary`` is :func:`check_probabilities` of ``q``. The rows are not divided by
    their masses: the minimiser of :math:`\mathrm{KL}(p \| q)` is that of
    :math:`\mathrm{KL}(p \| q / s)` (the two differ by :math:`\log s`), and the water
    levels absorb the scale, so :func:`_block` takes the masses instead of a
    renormalised copy. A row changed exactly when raising its entries changed its
    sum; the others get mass 1.0 and stay bit for bit as they were.
    """
    ones = np.ones(q.shape[0])
    if q.size == 0 or summary.smallest >= FLOOR:
        return q, ones
    fixed = np.maximum(q, FLOOR)
    after = _row_sums(fixed)
    return fixed, np.where(after == summary.sums, ones, after)


def _prepare(
    f: npt.ArrayLike, q: npt.ArrayLike, budget: npt.ArrayLike
) -> tuple[FloatArray, FloatArray, FloatArray, np.dtype[np.floating]]:
    f_in = np.asarray(f)
    q_in = np.asarray(q)
    dtype = np.result_type(f_in.dtype, q_in.dtype, np.float32)
    if not np.issubdtype(dtype, np.floating):
        raise ValueError(
            f"f and q must be real arrays, got {f_in.dtype} and {q_in.dtype}"
        )
    f64 = np.asarray(f_in, dtype=np.float64)
    q64 = np.asarray(q_in, dtype=np.float64)
    if f64.ndim != 2 or f64.shape != q64.shape or f64.shape[1] == 0:
        raise ValueError(
            f"f and q must have the same shape (N, K) with K >= 1, got {f64.shape} and "
            f"{q64.shape}"
        )
    if f64.shape[1] >= _MAX_COLUMNS:
        raise ValueError(f"K must be < {_MAX_COLUMNS}, got {f64.shape[1]}")
    b64 = np.asarray(budget, dtype=np.float64)
    _check_budget(b64, f64.shape[0])
    return f64, q64, b64, np.dtype(dtype)


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
    f: torch.Tensor, q: torch.Tensor, budget: torch.Tensor | npt.ArrayLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not (torch.is_floating_point(f) and torch.is_floating_point(q)):
        raise ValueError(f"f and q must be floating-point, got {f.dtype} and {q.dtype}")
    if f.ndim != 2 or f.shape != q.shape or f.shape[1] == 0:
        raise ValueError(
            f"f and q must have the same shape (N, K) with K >= 1, got "
            f"{tuple(f.shape)} and {tuple(q.shape)}"
        )
    tol = max(sum_tolerance(f.dtype, f.shape[1]), sum_tolerance(q.dtype, f.shape[1]))
    f64 = f.detach().to(torch.float64)
    q64 = q.detach().to(device=f.device, dtype=torch.float64)
    _check_torch("f", f64, tol)
    _check_torch("q", q64, tol)
    b64 = torch.as_tensor(budget, dtype=torch.float64).to(f.device)
    if b64.shape != (f.shape[0],):
        raise ValueError(
            f"budget must have shape ({f.shape[0]},), got {tuple(b64.shape)}"
        )
    if not torch.all(torch.isfinite(b64)):
        raise ValueError("budget contains NaN or inf")
    if b64.numel() and float(b64.min()) < 0:
        raise ValueError(f"budget must be >= 0, got min {float(b64.min())!r}")
    if q64.numel() and float(q64.min()) < FLOOR:
        q64 = q64.clamp(min=FLOOR)
        q64 = q64 / q64.sum(1, keepdim=True)
    return f64, q64, b64


IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def _first_true(
    steps: int, lo: IntArray, hi: IntArray, test: Callable[[IntArray], BoolArray]
) -> IntArray:
    """Per row, the smallest index in ``[lo, hi]`` where a monotone test holds.

    ``test`` is False then True along the index and is taken to hold at ``hi``;
    ``steps`` halvings must cover the range (``bit_length(hi - lo) + 1``).
    """
    for _ in range(steps):
        mid = (lo + hi) >> 1
        ok = test(mid) | (lo >= hi)
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid + 1)
    return lo


def _sorted_ratios(
    f: FloatArray, q: FloatArray
) -> tuple[FloatArray, npt.NDArray[np.int64]]:
    """Ratios ``f/q`` sorted per row, and the flat indices of the sorting permutation.

    The column index is written into the lowest ``ceil(log2 K)`` mantissa bits of each
    non-negative ratio (which keeps the float order up to a relative ``2**-42`` at
    ``K = 1000``), so a single float sort gives the order and the permutation.
    """
    n, k = f.shape
    bits = max(1, int(k - 1).bit_length())
    mask = np.int64((1 << bits) - 1)
    ratio = f / q
    raw = ratio.view(np.int64)
    raw &= ~mask
    raw |= np.arange(k, dtype=np.int64)
    ratio.sort(axis=1)
    index = raw & mask
    index += (np.arange(n, dtype=np.int64) * k)[:, None]
    return ratio, index


def _levels_dense(
    ratio: FloatArray,
    fp: FloatArray,
    qp: FloatArray,
    qs_rev: FloatArray,
    half: FloatArray,
) -> tuple[IntArray, IntArray]:
    """Breakpoint indices by testing every breakpoint (cheapest for small K).

    Both tests are monotone along a row (the raising cost grows with the level, the
    lowering cost shrinks), so each index is the first change of a boolean row. A
    sentinel column ends every row, and ``argmin`` / ``argmax`` find the change
    without the per-row reduction of a count, which dominates at K = 10.
    """
    n, k = ratio.shape
    h = half[:, None]
    work = np.empty((n, k - 1))
    test = np.empty((n, k), dtype=np.bool_)
    test[:, -1] = False
    np.multiply(ratio[:, 1:], qp[:, :-1], out=work)
    work -= fp[:, :-1]
    np.less_equal(work, h, out=test[:, :-1])
    j_a = test.argmin(axis=1)
    np.multiply(ratio[:, :-1], qs_rev[:, ::-1], out=work)
    work += fp[:, :-1]
    test[:, -1] = True
    np.greater_equal(work, fp[:, -1:] - h, out=test[:, :-1])
    j_b = test.argmax(axis=1)
    return j_a, j_b


def _levels_search(
    ratio: FloatArray,
    fp: FloatArray,
    qp: FloatArray,
    qs_rev: FloatArray,
    half: FloatArray,
) -> tuple[IntArray, IntArray]:
    """Breakpoint indices by binary search (O(N log K) gathers, for large K)."""
    n, k = ratio.shape
    flat_r, flat_fp, flat_qp, flat_qs = (
        ratio.ravel(),
        fp.ravel(),
        qp.ravel(),
        qs_rev.ravel(),
    )
    base = np.arange(n, dtype=np.int64) * k
    base_s = np.arange(n, dtype=np.int64) * (k - 1)
    total = flat_fp[base + k - 1]
    steps = int(k).bit_length() + 1
    zeros = np.zeros(n, dtype=np.int64)

    def raise_fails(index: IntArray) -> BoolArray:
        at = base + index
        level = flat_r[base + np.minimum(index + 1, k - 1)]
        out: BoolArray = level * flat_qp[at] - flat_fp[at] > half
        return out

    def lower_holds(index: IntArray) -> BoolArray:
        safe = np.minimum(index, k - 2)
        above_f = total - flat_fp[base + safe]
        above_q = flat_qs[base_s + (k - 2 - safe)]
        cost = above_f - flat_r[base + safe] * above_q
        out: BoolArray = (index >= k - 1) | (cost <= half)
        return out

    last = np.full(n, k - 1, dtype=np.int64)
    j_a = _first_true(steps, zeros, last, raise_fails)
    j_b = _first_true(steps, zeros, last, lower_holds)
    return j_a, j_b


DENSE_MAX_K = 64
"""Up to this K the breakpoints are counted densely, above it binary-searched."""

BLOCK_ELEMENTS = 1 << 17
"""Rows are processed in blocks of about this many entries (1 MiB per float64 array),
so the intermediate arrays of a block stay in cache."""

DENSE_BLOCK_ELEMENTS = 1 << 15
"""The block size when the levels are found densely (K <= :data:`DENSE_MAX_K`):
that path makes few numpy calls per block, so smaller, cache-resident blocks win."""


def _cumsum_rows(values: FloatArray, out: FloatArray) -> FloatArray:
    """Row-wise prefix sums, written into ``out`` (which may be ``values``).

    torch's kernel runs 2-7x faster than ``numpy.cumsum`` along rows on CPU; both
    arrays are shared with torch without a copy.
    """
    torch.cumsum(torch.from_numpy(values), 1, out=torch.from_numpy(out))
    return out


def _block(
    f: FloatArray, q: FloatArray, mass: FloatArray, budget: FloatArray, out: FloatArray
) -> None:
    """Water-filling on a block of rows, written into ``out``.

    Row ``i`` of ``q`` sums to ``mass[i]`` (the floor raised some entries); the
    levels found are those of ``q`` itself, :math:`w / s` for the normalised levels
    :math:`w`, so only the trivial case needs the mass.
    """
    n, k = f.shape
    half = 0.5 * budget
    ratio, order = _sorted_ratios(f, q)
    fp = f.take(order)
    qp = q.take(order)
    qs_rev = qp[:, :0:-1].copy()
    _cumsum_rows(qs_rev, qs_rev)
    _cumsum_rows(fp, fp)
    _cumsum_rows(qp, qp)
    levels = _levels_dense if k <= DENSE_MAX_K else _levels_search
    j_a, j_b = levels(ratio, fp, qp, qs_rev, half)

    start = np.arange(n, dtype=np.int64) * k
    prefix_f, prefix_q = fp.ravel(), qp.ravel()
    total = fp[:, -1]
    at_a = start + j_a
    w_a = (prefix_f.take(at_a) + half) / prefix_q.take(at_a)
    before_b = prefix_f.take(start + np.maximum(j_b - 1, 0))
    above_f = np.where(j_b > 0, total - before_b, total)
    suffix = qs_rev.ravel().take(start - np.arange(n) + np.minimum(k - 1 - j_b, k - 2))
    above_q = np.where(j_b > 0, suffix, qp[:, -1])
    w_b = (above_f - half) / above_q
    # the raised mass reaches q itself (w_A >= 1 for the normalised q) exactly when
    # ||q - f||_1 <= B; then w_A = w_B = 1 / s gives min(max(f, q / s), q / s) = q / s
    trivial = w_a * mass >= 1.0
    w_a[trivial] = w_b[trivial] = 1.0 / mass[trivial]

    np.multiply(q, w_a[:, None], out=out)
    np.maximum(out, f, out=out)
    np.multiply(q, w_b[:, None], out=ratio)
    np.minimum(out, ratio, out=out)


def _water_filling_numpy(
    f: FloatArray, q: FloatArray, budget: FloatArray, tolerance: float
) -> FloatArray:
    """Validate and solve block by block, so each block is read from memory once."""
    n, k = f.shape
    out = np.empty_like(f)
    entries = DENSE_BLOCK_ELEMENTS if k <= DENSE_MAX_K else BLOCK_ELEMENTS
    step = max(1, entries // k)
    for start in range(0, n, step):
        part = slice(start, start + step)
        f_part = f[part]
        check_probabilities("f", f_part, tolerance, start)
        q_part, mass = _floored(
            q[part], check_probabilities("q", q[part], tolerance, start)
        )
        if k == 1:
            out[part] = q_part / mass[:, None]
        else:
            _block(f_part, q_part, mass, budget[part], out[part])
    return out


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


@overload
def water_filling(
    f: torch.Tensor, q: torch.Tensor, budget: torch.Tensor | npt.ArrayLike
) -> torch.Tensor: ...


@overload
def water_filling(
    f: npt.ArrayLike, q: npt.ArrayLike, budget: npt.ArrayLike
) -> npt.NDArray[np.floating]: ...


def water_filling(
    f: torch.Tensor | npt.ArrayLike,
    q: torch.Tensor | npt.ArrayLike,
    budget: torch.Tensor | npt.ArrayLike,
) -> torch.Tensor | npt.NDArray[np.floating]:
    r"""Solve :math:`\min_p \mathrm{KL}(p\|q)` s.t. :math:`\|p-f\|_1 \le B`, row by row.

    Parameters
    ----------
    f : array or torch.Tensor of shape (N, K)
        Rows on the probability simplex (the model's outputs); zeros allowed.
    q : array or torch.Tensor of shape (N, K)
        Rows on the simplex (the class prototypes); entries below :data:`FLOOR` are
        raised to it and the row renormalised.
    budget : array or torch.Tensor of shape (N,)
        L1 budgets :math:`B \ge 0`; :math:`B \ge 2` always returns ``q``.

    Returns
    -------
    array or torch.Tensor of shape (N, K)
        The minimisers, in the dtype (and, for torch, on the device) of ``f``.

    Raises
    ------
    ValueError
        On mismatched shapes, NaN or inf, negative entries, rows not summing to one,
        or a negative budget.

    Examples
    --------
    >>> import numpy as np
    >>> f, q = np.array([[.7, .2, .1]]), np.array([[.1, .3, .6]])
    >>> water_filling(f, q, np.array([.4]))
    array([[0.5, 0.2, 0.3]])
    """
    if isinstance(f, torch.Tensor) or isinstance(q, torch.Tensor):
        if not (isinstance(f, torch.Tensor) and isinstance(q, torch.Tensor)):
            raise TypeError("f and q must both be torch tensors or both be arrays")
        ft, qt, bt = _prepare_torch(f, q, budget)
        return _water_filling_torch(ft, qt, bt).to(f.dtype)
    f64, q64, b64, dtype = _prepare(f, q, budget)
    tolerance = sum_tolerance(dtype, f64.shape[1])
    return _water_filling_numpy(f64, q64, b64, tolerance).astype(dtype, copy=False)
