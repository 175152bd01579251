"""Speed of the SSD projection, side by side in one run (a measurement benchmark).

For one (N, K) batch of random instances (Dirichlet(0.3) rows ``f`` and ``q``,
budgets uniform in ``[0, max_budget]``, so that most rows take the non-trivial
branch; SSD's own budget ``epsilon * H(f)`` exceeds 2 for most such rows at K = 1000,
where the answer is simply ``q``), time, interleaved and repeated, single-threaded;
the time is the process CPU time (wall time counts the periods another job holds the
core, which on a shared 2-core machine swamps the measurement) and the minimum over
repeats is kept:

* ``none``: ``numpy.sort`` of the same (N, K) array, the floor of any sort-based
  algorithm (the reference variant of the paired deltas);
* ``water_filling``: the numpy closed form;
* ``water_filling_torch``: the torch closed form (CPU; optional);
* ``cvxpy``: :func:`~defenses.ssd.solver.solve_reference` on the first ``cvxpy_rows``
  rows, reported per row, after one warm-up solve (cvxpy's first call in a process
  pays for imports and canonicalisation caches, which would flatter the speed-up).

Each record carries its time per row and its ratio to the sort, and the
``water_filling`` record the largest objective gap to cvxpy on the solved rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from defenses.checks import check_int, check_keys
from defenses.harness import measurement
from defenses.registry import register
from defenses.results import Result
from defenses.ssd.solver import kl_objective, solve_reference
from defenses.ssd.waterfill import water_filling
from defenses.threads import single_thread

BENCHMARK = "ssd-perf"
FloatArray = npt.NDArray[np.float64]


def _positive_int(params: dict[str, Any], name: str, default: int) -> int:
    return check_int(f"{BENCHMARK}.{name}", params.get(name, default), 1)


def _cpu_time(function: Callable[[], object]) -> float:
    start = time.process_time()
    function()
    return time.process_time() - start


def _timings(
    f: FloatArray, q: FloatArray, budget: FloatArray, repeats: int, with_torch: bool
) -> dict[str, float]:
    """Minimum CPU time of each variant over interleaved repeats (single-threaded)."""
    f_t, q_t, b_t = (torch.from_numpy(a) for a in (f, q, budget))
    variants: dict[str, Callable[[], object]] = {
        "none": lambda: np.sort(f, axis=1),
        "water_filling": lambda: water_filling(f, q, budget),
    }
    if with_torch:
        variants["water_filling_torch"] = lambda: water_filling(f_t, q_t, b_t)
    best = dict.fromkeys(variants, np.inf)
    with single_thread():
        for _ in range(repeats):
            for name, function in variants.items():
                best[name] = min(best[name], _cpu_time(function))
    return best


@register("benchmarks", BENCHMARK)
def speed(params: dict[str, Any], seeds: list[int]) -> Iterator[Result]:
    """Time ``water_filling`` against ``numpy.sort`` and cvxpy.

    Parameters
    ----------
    params : dict
        ``K`` (classes), ``N`` (rows, default 10,000), ``repeats`` (default 5),
        ``cvxpy_rows`` (default 5), ``max_budget`` (default 1.0), ``torch``
        (also time the torch version, default true).
    seeds : list of int
        One measurement per seed.
    """
    allowed = {"K", "N", "repeats", "cvxpy_rows", "max_budget", "torch"}
    check_keys(BENCHMARK, params, allowed)
    k = _positive_int(params, "K", 10)
    n = _positive_int(params, "N", 10_000)
    repeats = _positive_int(params, "repeats", 5)
    rows = min(_positive_int(params, "cvxpy_rows", 5), n)
    max_budget = float(params.get("max_budget", 1.0))
    if not 0 < max_budget <= 2:
        raise ValueError(
            f"{BENCHMARK}: max_budget must lie in (0, 2], got {max_budget!r}"
        )
    with_torch = params.get("torch", True)
    if not isinstance(with_torch, bool):
        raise ValueError(
            f"{BENCHMARK}: torch must be true or false, got {with_torch!r}"
        )
    setting = {
        "torch": with_torch,
        "K": k,
        "N": n,
        "repeats": repeats,
        "cvxpy_rows": rows,
        "max_budget": max_budget,
    }
    for seed in seeds:
        rng = np.random.default_rng(seed)
        f = rng.dirichlet(np.full(k, 0.3), n)
        q = rng.dirichlet(np.full(k, 0.3), n)
        budget = rng.uniform(0.0, max_budget, n)
        best = _timings(f, q, budget, repeats, with_torch)
        solve_reference(f[-1:], q[-1:], budget[-1:])
        start = time.process_time()
        reference = solve_reference(f[:rows], q[:rows], budget[:rows])
        cvxpy_row = (time.process_time() - start) / rows
        ours = water_filling(f[:rows], q[:rows], budget[:rows])
        gap = float(
            np.max(kl_objective(ours, q[:rows]) - kl_objective(reference, q[:rows]))
        )
        full = water_filling(f, q, budget)
        sort_time = best["none"]
        for name, seconds in best.items():
            per_row = seconds / n
            cost = {
                "seconds": seconds,
                "per_row_us": 1e6 * per_row,
                "ratio_to_sort": seconds / sort_time,
                "speedup_vs_cvxpy": cvxpy_row / per_row,
            }
            utility = {}
            if name == "water_filling":
                utility = {
                    "objective_gap_vs_cvxpy": gap,
                    "max_sum_error": float(np.abs(full.sum(axis=1) - 1.0).max()),
                    "max_budget_excess": float(
                        np.max(np.abs(full - f).sum(axis=1) - budget)
                    ),
                }
            yield measurement(
                BENCHMARK, name, seed, utility=utility, cost=cost, params=setting
            )
        yield measurement(
            BENCHMARK,
            "cvxpy",
            seed,
            cost={
                "seconds": cvxpy_row * n,
                "per_row_us": 1e6 * cvxpy_row,
                "ratio_to_sort": cvxpy_row * n / sort_time,
                "speedup_vs_cvxpy": 1.0,
            },
            params=setting,
        )
