"""Benchmark ``crypto-lora``: one encrypted linear layer, LoRA vs full weights.

Encrypted LoRA (r = 2) versus encrypted full weights: forward and weight gradient
(the paper's 6.94x fine-tuning speedup combines this with the Gaussian kernel),
plus encrypted LoRA SGD steps checked against the plaintext step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from defenses.checks import int_param
from defenses.harness import measurement
from defenses.results import Result

from ..he.ckks import CKKSParams, make_context
from ..program.lora_he import (
    encrypted_steps,
    full_forward,
    full_gradient,
    lora_forward,
    lora_gradient,
    simulate_step,
)

LORA_PARAMS = CKKSParams(8192, (40, 30, 30, 30, 30, 40), 30)


def _lora_run(
    d: int, rank: int, tokens: int, entries: int, rng: np.random.Generator
) -> dict[str, dict[str, float]]:
    ctx = make_context(LORA_PARAMS, galois=True)
    import tenseal as ts

    X = rng.standard_normal((tokens, d)) * 0.3
    G = rng.standard_normal((tokens, d)) * 0.3
    W0 = rng.standard_normal((d, d)) / math.sqrt(d)
    A = rng.standard_normal((d, rank)) / math.sqrt(d)
    B = rng.standard_normal((rank, d)) / math.sqrt(d)

    def rep(value: float) -> Any:
        return ts.ckks_vector(ctx, [value] * tokens)

    x = [ts.ckks_vector(ctx, list(X[:, g])) for g in range(d)]
    grad = [ts.ckks_vector(ctx, list(G[:, f])) for f in range(d)]
    W = [[rep(float(w)) for w in row] for row in W0 + A @ B]
    Ae = [[rep(float(a)) for a in row] for row in A]
    Be = [[rep(float(b)) for b in row] for row in B]

    start = time.perf_counter()
    full_forward(x, W)
    full_fwd = time.perf_counter() - start
    start = time.perf_counter()
    y, xa = lora_forward(x, W0, Ae, Be)
    lora_fwd = time.perf_counter() - start
    measured = min(entries, d * d)
    chosen = rng.choice(d * d, measured, replace=False)
    pairs = [(int(i) // d, int(i) % d) for i in chosen]
    start = time.perf_counter()
    sums = full_gradient(x, grad, pairs)
    full_grad = (time.perf_counter() - start) * (d * d) / measured
    start = time.perf_counter()
    grad_a, grad_b = lora_gradient(x, xa, grad, Be)
    lora_grad = time.perf_counter() - start
    want_full = X.T @ G
    err_full = max(
        abs(s.decrypt()[0] - want_full[g, f])
        for s, (g, f) in zip(sums, pairs, strict=True)
    )
    want_b = (X @ A).T @ G
    err_lora = float(
        np.max(
            np.abs(np.array([[v.decrypt()[0] for v in row] for row in grad_b]) - want_b)
        )
    )
    err_fwd = float(
        np.max(np.abs(np.array([v.decrypt() for v in y]).T - X @ (W0 + A @ B)))
    )
    del grad_a
    return {
        "none": {
            "forward_s": full_fwd,
            "gradient_s": full_grad,
            "encrypted_weights": float(d * d),
            "gradient_entries_measured": float(measured),
            "max_error": float(err_full),
        },
        "lora": {
            "forward_s": lora_fwd,
            "gradient_s": lora_grad,
            "encrypted_weights": float(2 * d * rank),
            "gradient_entries_measured": float(2 * d * rank),
            "max_error": max(err_lora, err_fwd),
        },
    }


def lora_benchmark(params: Mapping[str, Any], seeds: list[int]) -> Iterable[Result]:
    """Encrypted LoRA vs full encrypted weights, and SGD steps vs simulation."""
    d = int_param(params, "d", 16)
    rank = int_param(params, "rank", 2)
    tokens = int_param(params, "tokens", 256)
    entries = int_param(params, "full_gradient_entries", 32)
    steps = int_param(params, "sgd_steps", 1)
    sgd_d = int_param(params, "sgd_d", 8)
    lr = float(params.get("lr", 0.5))
    settings = {"d": d, "rank": rank, "tokens": tokens}
    for seed in seeds:
        rng = np.random.default_rng(seed)
        runs = _lora_run(d, rank, tokens, entries, rng)
        X = rng.standard_normal((tokens, sgd_d)) * 0.3
        Y = rng.standard_normal((tokens, sgd_d)) * 0.3
        W0 = rng.standard_normal((sgd_d, sgd_d)) / math.sqrt(sgd_d)
        A = rng.standard_normal((sgd_d, rank)) / math.sqrt(sgd_d)
        B = rng.standard_normal((rank, sgd_d)) / math.sqrt(sgd_d)
        start = time.perf_counter()
        ctx = make_context(LORA_PARAMS, galois=True)
        enc_a, enc_b, rounds = encrypted_steps(ctx, X, Y, W0, A, B, lr, steps)
        sgd_s = time.perf_counter() - start
        sim_a, sim_b = A, B
        for _ in range(steps):
            sim_a, sim_b = simulate_step(X, Y, W0, sim_a, sim_b, lr)
        step_diff = float(max(np.abs(enc_a - sim_a).max(), np.abs(enc_b - sim_b).max()))
        moved = float(max(np.abs(sim_a - A).max(), np.abs(sim_b - B).max()))
        full = runs["none"]
        for name, run in runs.items():
            extra = {}
            if name == "lora":
                extra = {
                    "forward_speedup": full["forward_s"] / run["forward_s"],
                    "gradient_speedup": full["gradient_s"] / run["gradient_s"],
                    "sgd_step_diff": step_diff,
                    "sgd_update_size": moved,
                }
            else:
                extra = {
                    "forward_speedup": 1.0,
                    "gradient_speedup": 1.0,
                    "sgd_step_diff": 0.0,
                    "sgd_update_size": 0.0,
                }
            cost = {**run}
            if name == "lora":
                cost.update({"sgd_s": sgd_s, "sgd_refresh_rounds": float(rounds)})
            yield measurement(
                "crypto-lora",
                name,
                seed,
                utility={"max_error": run["max_error"], **extra},
                cost=cost,
                params={**settings, "variant": "full" if name == "none" else name},
            )
