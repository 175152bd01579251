r"""Reference solver of the SSD projection with cvxpy (for tests and the benchmark).

Solves, one row at a time, the convex program

.. math::

    \min_{p} \sum_i p_i \log \frac{p_i}{q_i}
    \quad \text{s.t.} \quad \lVert p - f \rVert_1 \le B,\; p \ge 0,\;
    \textstyle\sum_i p_i = 1

with a generic conic solver (CLARABEL). It is orders of magnitude slower than the
closed form of :func:`defenses.ssd.waterfill.water_filling` and, near the boundary of
the simplex, less accurate: a solver may report ``optimal_inaccurate``. Compare
objectives, or arguments on well-conditioned instances only.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.ssd.waterfill import (
    FLOOR,
    check_probabilities,
    prepare_inputs,
    sum_tolerance,
)

logger = logging.getLogger(__name__)


def kl_objective(p: npt.ArrayLike, q: npt.ArrayLike) -> FloatArray:
    r"""Row-wise :math:`\mathrm{KL}(p\|q) = \sum_i p_i \log(p_i / q_i)` (0 log 0 = 0).

    Entries of ``q`` below :data:`~defenses.ssd.waterfill.FLOOR` are raised to it, as
    in the projection.
    """
    from scipy.special import rel_entr

    p_arr = np.asarray(p, dtype=np.float64)
    q_arr = np.maximum(np.asarray(q, dtype=np.float64), FLOOR)
    q_arr = q_arr / q_arr.sum(axis=-1, keepdims=True)
    out: FloatArray = rel_entr(p_arr, q_arr).sum(axis=-1)
    return out


def solve_reference(
    f: npt.ArrayLike, q: npt.ArrayLike, budget: npt.ArrayLike, solver: str = "CLARABEL"
) -> FloatArray:
    r"""Solve :math:`\min_p \mathrm{KL}(p\|q)` s.t. :math:`\|p-f\|_1\le B` with cvxpy.

    Parameters
    ----------
    f, q : array of shape (N, K)
        Rows on the probability simplex.
    budget : array of shape (N,)
        L1 budgets, >= 0.
    solver : str
        A cvxpy solver that handles the exponential cone.

    Returns
    -------
    ndarray of shape (N, K)
        The solver's minimisers (clipped at 0; each row renormalised).

    Raises
    ------
    ValueError
        On bad shapes or values, as :func:`~defenses.ssd.waterfill.water_filling`.
    RuntimeError
        If the solver (and SCS after it) fails on a row.
    """
    import cvxpy

    cp: Any = cvxpy

    f_arr, q_arr, b_arr, dtype = prepare_inputs(f, q, budget)
    n, k = f_arr.shape
    tol = sum_tolerance(dtype, k)
    check_probabilities("f", f_arr, tol)
    check_probabilities("q", q_arr, tol)
    q_arr = np.maximum(q_arr, FLOOR)
    q_arr = q_arr / q_arr.sum(axis=1, keepdims=True)
    out = np.empty_like(f_arr)
    for row in range(n):
        p = cp.Variable(k, nonneg=True)
        problem = cp.Problem(
            cp.Minimize(cp.sum(cp.rel_entr(p, q_arr[row]))),
            [cp.norm1(p - f_arr[row]) <= b_arr[row], cp.sum(p) == 1],
        )
        try:
            problem.solve(solver=solver)
        except cvxpy.error.SolverError:
            logger.warning("%s failed on row %d; retrying with SCS", solver, row)
            problem.solve(solver="SCS", eps=1e-8, max_iters=20_000)
        if p.value is None or problem.status not in ("optimal", "optimal_inaccurate"):
            raise RuntimeError(f"cvxpy failed on row {row}: status {problem.status}")
        if problem.status == "optimal_inaccurate":
            logger.warning("cvxpy reports optimal_inaccurate on row %d", row)
        value = np.maximum(np.asarray(p.value, dtype=np.float64), 0.0)
        out[row] = value / value.sum()
    return out
