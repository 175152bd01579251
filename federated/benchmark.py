"""Measurement benchmarks of the package (not attack games).

* :func:`audit_controls` - the canary audit on a correctly accounted save/spend
  client (variant ``"none"``) and on three broken accountants it must catch:
  ``wrong-rate`` (the accountant is fed a wrong, smaller rate for every step),
  ``no-saving-steps`` (the saving phase is left out of the history) and
  ``fixed-batches`` (the client cuts fixed-size batches in order but is accounted as
  Poisson sampling). Success: the epsilon lower bound and whether it exceeds the
  claimed epsilon (``violation``).
* :func:`flower_side_by_side` - the same time-adaptive run through the in-process
  loop and through the Flower app in simulation (Ray), timed side by side, with the
  realised epsilon each client reports over Flower.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from defenses.harness import measurement
from defenses.results import Result

from .accounting import Phase, epsilon
from .audit import canary_audit
from .client import Sampling, StepPlan

CONTROLS = ("none", "wrong-rate", "no-saving-steps", "fixed-batches")


def _control(
    name: str, params: Mapping[str, Any]
) -> tuple[list[StepPlan], list[Phase], Sampling, list[float] | None]:
    sigma = float(params.get("sigma", 1.2))
    steps = int(params.get("steps", 4))
    save_rounds = int(params.get("save_rounds", 20))
    spend_rounds = int(params.get("spend_rounds", 1))
    q_sav = float(params.get("save_rate", 0.3))
    q_spd = float(params.get("spend_rate", 0.35))
    q_wrong = float(params.get("wrong_rate", 0.02))
    q_fixed = float(params.get("fixed_rate", 0.05))
    plans = [StepPlan(q_sav, steps, sigma)] * save_rounds + [
        StepPlan(q_spd, steps, sigma)
    ] * spend_rounds
    true: list[Phase] = [
        (sigma, q_sav, save_rounds * steps),
        (sigma, q_spd, spend_rounds * steps),
    ]
    total = (save_rounds + spend_rounds) * steps
    if name == "none":
        return plans, true, "poisson", None
    if name == "wrong-rate":
        return plans, [(sigma, q_wrong, total)], "poisson", [q_wrong] * total
    if name == "no-saving-steps":
        return plans, true[1:], "poisson", None
    if name == "fixed-batches":
        fixed = [StepPlan(q_fixed, steps, sigma)] * (save_rounds + spend_rounds)
        return fixed, [(sigma, q_fixed, total)], "fixed", None
    raise ValueError(f"unknown audit control {name!r}; known: {CONTROLS}")


def audit_controls(params: Mapping[str, Any], seeds: list[int]) -> Iterator[Result]:
    """Audit a correct accountant and three broken ones, seed by seed."""
    delta = float(params.get("audit_delta", 1e-2))
    trials = int(params.get("trials", 4000))
    n_records = int(params.get("n_records", 20))
    for seed in seeds:
        for variant in CONTROLS:
            plans, claimed_history, sampling, claimed_rates = _control(variant, params)
            claimed = epsilon(claimed_history, delta)
            start = time.perf_counter()
            result = canary_audit(
                plans,
                claimed,
                delta=delta,
                n_records=n_records,
                trials=trials,
                rng=np.random.default_rng([seed, CONTROLS.index(variant)]),
                sampling=sampling,
                claimed_rates=claimed_rates,
            )
            yield measurement(
                "federated-audit-controls",
                variant,
                seed,
                success={
                    "eps_lb": result.eps_lower_bound,
                    "violation": float(result.violated),
                },
                certificate={"eps_claimed": claimed},
                cost={"audit_s": time.perf_counter() - start},
                params={**params, "control": variant},
            )


def flower_side_by_side(
    params: Mapping[str, Any], seeds: list[int]
) -> Iterator[Result]:
    """Run one configuration in-process (``none``) and on Flower (``flower``).

    The Flower run opts into the research seed (the same noise as in-process, so
    the two can be compared bit for bit) and keeps its simulated nodes' ledgers in
    a fresh folder per seed (each seed is a separate simulated population).
    """
    import tempfile

    from .flower.config import AppConfig
    from .flower.run import run_in_process, run_simulation

    for seed in seeds:
        config = AppConfig.from_mapping({**params, "seed": seed})
        for variant in ("none", "flower"):
            start = time.perf_counter()
            if variant == "none":
                run = run_in_process(config)
            else:
                with tempfile.TemporaryDirectory() as ledgers:
                    run = run_simulation(config, research_seed=seed, state_dir=ledgers)
            wall = time.perf_counter() - start
            ratios = [e / b for e, b in zip(run.epsilons, run.budgets, strict=True)]
            yield measurement(
                "federated-flower",
                variant,
                seed,
                utility={"accuracy": run.curve[-1]},
                certificate={
                    "eps_max": max(run.epsilons),
                    "spent_ratio_max": max(ratios),
                    "spent_ratio_min": min(ratios),
                },
                cost={"wall_s": wall},
                params={**params, "engine": variant},
            )
