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

The numpy version finds both levels without sorting: one compiled loop per row
(:func:`defenses.ssd.kernels.project_rows`) computes the ratios and the input checks'
statistics in one read, then runs Newton's method on each level, whose steps are the
closed form on a shrinking active set and which ends exactly at its solution; rows that
need many steps fall back to sorting their surviving ratios. The torch version
follows the paper's GPU algorithm (Alg. 3): one sort, prefix sums and dense masks.
Both compute in float64 and return the input's dtype. The closed form is written
here because no library has it: a general convex solver (cvxpy, kept as
:func:`~defenses.ssd.solver.solve_reference` for the tests) solves the same problem
about 10,000 times slower per row.

Entries of ``q`` below ``floor`` are raised to ``floor`` and the rows renormalised
(in effect: the levels absorb the row's new mass): :math:`\mathrm{KL}(p \| q)` is
infinite wherever :math:`q_i = 0 < p_i`, so a zero (e.g. a float32 underflow) would
make the problem infeasible for small budgets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast, overload

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.ssd.lazy import is_tensor, is_torch_dtype, loaded_torch

if TYPE_CHECKING:
    import torch

FLOOR = 1e-12
"""Smallest entry of ``q`` used in the projection (zeros are raised to it)."""


def sum_tolerance(dtype: np.dtype[np.floating] | torch.dtype, n_classes: int) -> float:
    """Tolerance on ``|sum(row) - 1|`` for probability rows of a given dtype.

    float64 rows must sum to one within ``1e-6``; lower precisions within
    ``1e-6 + 8 * eps * K`` (a float32 softmax over 1000 classes sums to one only to
    about ``1e-5``).
    """
    torch_module = loaded_torch()
    if torch_module is not None and is_torch_dtype(dtype):
        eps = float(torch_module.finfo(dtype).eps)
    else:
        eps = float(np.finfo(cast("np.dtype[np.floating]", dtype)).eps)
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


def _check_rows(
    name: str,
    sums: FloatArray,
    smallest: float,
    tolerance: float,
    first_row: int = 0,
) -> None:
    """Raise ValueError unless rows sum to 1 and the least entry is non-negative.

    NaN and inf entries show as non-finite sums; ``first_row`` offsets the row index
    in the message (for a block of a larger array).
    """
    if not np.isfinite(sums).all():
        raise ValueError(f"{name} contains NaN or inf")
    if smallest < 0:
        raise ValueError(f"{name} has negative entries (min {smallest:.3g})")
    worst = int(np.argmax(np.abs(sums - 1.0)))
    if abs(sums[worst] - 1.0) > tolerance:
        raise ValueError(
            f"{name} rows must sum to 1 (within {tolerance:.1e}); "
            f"row {first_row + worst} sums "
            f"to {sums[worst]!r}"
        )


def check_probabilities(name: str, values: FloatArray, tolerance: float) -> None:
    """Raise ValueError unless ``values`` has finite, non-negative rows summing to 1.

    Parameters
    ----------
    name : str
        What the array is called in the error message.
    values : ndarray of shape (N, K)
        The rows to check.
    tolerance : float
        Largest allowed ``|sum(row) - 1|``.
    """
    if values.ndim != 2 or values.shape[1] == 0:
        raise ValueError(
            f"{name} must have shape (N, K) with K >= 1, got {values.shape}"
        )
    if values.size:
        _check_rows(name, _row_sums(values), float(values.min()), tolerance)


def _check_budget(budget: FloatArray, n: int) -> None:
    if budget.shape != (n,):
        raise ValueError(f"budget must have shape ({n},), got {budget.shape}")
    if not np.all(np.isfinite(budget)):
        raise ValueError("budget contains NaN or inf")
    if budget.size and budget.min() < 0:
        raise ValueError(f"budget must be >= 0, got min {budget.min()!r}")


def prepare_inputs(
    f: npt.ArrayLike, q: npt.ArrayLike, budget: npt.ArrayLike
) -> tuple[FloatArray, FloatArray, FloatArray, np.dtype[np.floating]]:
    """``f``, ``q`` and ``budget`` in float64, and the dtype of the answer.

    Checks what does not need a pass over the rows: real dtypes, matching (N, K)
    shapes with K >= 1, and a finite, non-negative budget of shape (N,). The rows'
    sums and signs are checked by the caller (:func:`check_probabilities`, or the
    statistics of the compiled pass). Both solvers of the projection, the closed form
    and :func:`~defenses.ssd.solver.solve_reference`, take their inputs through here.

    Raises
    ------
    ValueError
        On non-real dtypes, mismatched shapes, an empty class axis or a bad budget.
    """
    f_in = np.asarray(f)
    q_in = np.asarray(q)
    dtype = np.result_type(f_in.dtype, q_in.dtype, np.float32)
    if not np.issubdtype(dtype, np.floating):
        raise ValueError(
            f"f and q must be real arrays, got {f_in.dtype} and {q_in.dtype}"
        )
    f64 = np.ascontiguousarray(f_in, dtype=np.float64)
    q64 = np.ascontiguousarray(q_in, dtype=np.float64)
    if f64.ndim != 2 or f64.shape != q64.shape or f64.shape[1] == 0:
        raise ValueError(
            f"f and q must have the same shape (N, K) with K >= 1, got {f64.shape} and "
            f"{q64.shape}"
        )
    b_in = np.asarray(budget)
    if b_in.dtype.kind not in "fiub":
        raise ValueError(f"budget must be real numbers, got {b_in.dtype}")
    b64 = b_in.astype(np.float64)
    _check_budget(b64, f64.shape[0])
    return f64, q64, b64, np.dtype(dtype)


MAX_NEWTON_STEPS = 32
"""Newton steps per level before a row falls back to sorting its surviving ratios."""


def _water_filling_numpy(
    f: FloatArray, q: FloatArray, budget: FloatArray, tolerance: float
) -> FloatArray:
    """Solve every row in one compiled pass, then check the inputs' row statistics."""
    from defenses.ssd.batch import frozen
    from defenses.ssd.kernels import plain
    from defenses.ssd.kernels.background import pick
    from defenses.ssd.kernels.projection import project_rows  # imports numba

    out = np.empty_like(f)
    stats = np.empty((f.shape[0], 4))
    args = (frozen(f), frozen(q), FLOOR, frozen(0.5 * budget), MAX_NEWTON_STEPS)
    pick(project_rows, plain.project_rows, (*args, stats, out))(*args, stats, out)
    if f.size:
        for name, column in (("f", 0), ("q", 1)):
            smallest = float(stats[:, column + 2].min())
            _check_rows(name, stats[:, column], smallest, tolerance)
    return out


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
    if is_tensor(f) or is_tensor(q):
        if not (is_tensor(f) and is_tensor(q)):
            raise TypeError("f and q must both be torch tensors or both be arrays")
        from defenses.ssd.waterfill_torch import water_filling_torch

        k = f.shape[1] if f.ndim == 2 else 1
        tolerance = max(sum_tolerance(f.dtype, k), sum_tolerance(q.dtype, k))
        return water_filling_torch(f, q, budget, tolerance, FLOOR)
    f64, q64, b64, dtype = prepare_inputs(f, q, budget)
    tolerance = sum_tolerance(dtype, f64.shape[1])
    return _water_filling_numpy(f64, q64, b64, tolerance).astype(dtype, copy=False)
