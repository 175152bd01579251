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

from defenses.arrays import FloatArray
from defenses.checks import int_param
from defenses.harness import measurement
from defenses.results import Result

from ..he.ckks import CKKSParams, TenSEALBackend, local_key_owner
from ..he.evaluator import Evaluator, Value
from ..he.packing import unit
from ..program.lora_he import (
    Regression,
    encrypted_factors,
    encrypted_steps,
    full_forward,
    full_gradient,
    lora_forward,
    lora_gradient,
)

LORA_PARAMS = CKKSParams(8192, (40, 30, 30, 30, 30, 40), 30)


INTS = {
    "d": 16,
    "rank": 2,
    "tokens": 256,
    "full_gradient_entries": 32,
    "sgd_steps": 1,
    "sgd_d": 8,
}
"""The benchmark's integer parameters and their defaults (``lr`` is 0.5)."""
SPEEDUPS = ("forward_speedup", "gradient_speedup")
SGD = ("sgd_step_diff", "sgd_update_size")
"""The LoRA arm's ratios to the full arm and its SGD check (the full arm's 1 and 0)."""


def _since(ev: Evaluator, before: dict[str, int], scale: float) -> dict[str, float]:
    """The weight gradient's ciphertext products and slot sums, scaled like its time."""
    return {
        f"gradient_{op}": (ev.counts.get(op, 0) - before.get(op, 0)) * scale
        for op in ("ct_ct_mul", "slot_sums")
    }


def _lora_run(
    d: int, rank: int, tokens: int, entries: int, rng: np.random.Generator
) -> dict[str, dict[str, float]]:
    """Both arms' forward and weight gradient on one layer, timed and checked.

    The full arm's gradient is measured on ``entries`` random entries (every
    entry is the same product and slot sum) and scaled to :math:`d^2` entries;
    ``gradient_ct_ct_mul`` and ``gradient_slot_sums`` count the evaluator's
    operations behind each arm's gradient time (scaled alike).
    """
    encrypt, decrypt = local_key_owner(LORA_PARAMS, galois=True)
    ev = Evaluator(TenSEALBackend(), LORA_PARAMS.levels)
    X = rng.standard_normal((tokens, d)) * 0.3
    G = rng.standard_normal((tokens, d)) * 0.3
    W0 = rng.standard_normal((d, d)) / math.sqrt(d)
    A = rng.standard_normal((d, rank)) / math.sqrt(d)
    B = rng.standard_normal((rank, d)) / math.sqrt(d)

    def rep(value: float) -> Any:
        return encrypt(np.full(tokens, value))

    def opened(values: list[Value]) -> FloatArray:
        return np.array([decrypt(v.handle) for v in values]).T

    x = [Value(encrypt(col)) for col in X.T]
    grad = [Value(encrypt(col)) for col in G.T]
    W, (Ae, Be) = unit(rep, W0 + A @ B), encrypted_factors(ev, rep, A, B)

    start = time.perf_counter()
    full_forward(ev, x, W)
    full_fwd = time.perf_counter() - start
    start = time.perf_counter()
    y, xa = lora_forward(ev, x, W0, Ae, Be)
    lora_fwd = time.perf_counter() - start
    measured = min(entries, d * d)
    chosen = rng.choice(d * d, measured, replace=False)
    pairs = [(int(i) // d, int(i) % d) for i in chosen]
    counted = dict(ev.counts)
    start = time.perf_counter()
    sums = full_gradient(ev, x, grad, pairs)
    full_grad = (time.perf_counter() - start) * (d * d) / measured
    full_ops = _since(ev, counted, (d * d) / measured)
    counted = dict(ev.counts)
    start = time.perf_counter()
    _, grad_b = lora_gradient(ev, x, xa, grad, Be)
    lora_grad = time.perf_counter() - start
    lora_ops = _since(ev, counted, 1.0)

    def first(sums: list[list[Value]]) -> FloatArray:
        return np.array([[decrypt(v.handle)[0] for v in row] for row in sums])

    want = (X.T @ G)[tuple(np.array(pairs).T)]
    err_full = np.max(np.abs(first([sums])[0] - want))
    err_lora = np.max(np.abs(first(grad_b) - (X @ A).T @ G))
    err_fwd = np.max(np.abs(opened(y) - X @ (W0 + A @ B)))
    return {
        "none": {
            "forward_s": full_fwd,
            "gradient_s": full_grad,
            "encrypted_weights": float(d * d),
            "gradient_entries_measured": float(measured),
            "max_error": float(err_full),
            **full_ops,
        },
        "lora": {
            "forward_s": lora_fwd,
            "gradient_s": lora_grad,
            "encrypted_weights": float(2 * d * rank),
            "gradient_entries_measured": float(2 * d * rank),
            "max_error": float(max(err_lora, err_fwd)),
            **lora_ops,
        },
    }


def lora_benchmark(params: Mapping[str, Any], seeds: list[int]) -> Iterable[Result]:
    """Encrypted LoRA vs full encrypted weights, and SGD steps vs simulation."""
    d, rank, tokens, entries, steps, sgd_d = (
        int_param(params, name, default) for name, default in INTS.items()
    )
    lr = float(params.get("lr", 0.5))
    settings = {"d": d, "rank": rank, "tokens": tokens}
    for seed in seeds:
        rng = np.random.default_rng(seed)
        runs = _lora_run(d, rank, tokens, entries, rng)
        task = Regression(
            rng.standard_normal((tokens, sgd_d)) * 0.3,
            rng.standard_normal((tokens, sgd_d)) * 0.3,
            rng.standard_normal((sgd_d, sgd_d)) / math.sqrt(sgd_d),
        )
        A = rng.standard_normal((sgd_d, rank)) / math.sqrt(sgd_d)
        B = rng.standard_normal((rank, sgd_d)) / math.sqrt(sgd_d)
        start = time.perf_counter()
        enc_a, enc_b, rounds = encrypted_steps(LORA_PARAMS, task, A, B, lr, steps)
        sgd_s = time.perf_counter() - start
        sim_a, sim_b = A, B
        for _ in range(steps):
            sim_a, sim_b = task.step(sim_a, sim_b, lr)
        step_diff = float(max(np.abs(enc_a - sim_a).max(), np.abs(enc_b - sim_b).max()))
        moved = float(max(np.abs(sim_a - A).max(), np.abs(sim_b - B).max()))
        full, lora = runs["none"], runs["lora"]
        arms = {
            "none": (dict.fromkeys(SPEEDUPS, 1.0) | dict.fromkeys(SGD, 0.0), {}),
            "lora": (
                {
                    "forward_speedup": full["forward_s"] / lora["forward_s"],
                    "gradient_speedup": full["gradient_s"] / lora["gradient_s"],
                    "sgd_step_diff": step_diff,
                    "sgd_update_size": moved,
                },
                {"sgd_s": sgd_s, "sgd_refresh_rounds": float(rounds)},
            ),
        }
        for name, (extra, sgd) in arms.items():
            run = runs[name]
            yield measurement(
                "crypto-lora",
                name,
                seed,
                utility={"max_error": run["max_error"], **extra},
                cost={**run, **sgd},
                params={**settings, "variant": "full" if name == "none" else name},
            )
