"""Measurement benchmarks: the paper's speedups, measured side by side.

* ``crypto-attention`` - one encrypted attention head over rolled copies, Gaussian
  kernel versus polynomial softmax (Rho et al., 2025, report 2.3x faster inference).
  Each variant runs in the smallest ring that evaluates it without refreshes (the
  non-interactive configuration): GK needs 5 levels (N = 8192), softmax 11
  (N = 16384, a chain of 12). The interactive softmax (N = 8192 with client-aided
  refreshes) is measured too. Latency per sequence is the batch time divided by the
  ring's capacity (N/2 / n sequences), since a ciphertext costs the same however
  many of its slots are used.
* ``crypto-lora`` - one linear layer, encrypted LoRA (r = 2) versus encrypted full
  weights: forward and weight gradient (the paper's 6.94x fine-tuning speedup
  combines this with GK); plus encrypted LoRA SGD steps checked against the
  plaintext step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from crypto.approx import exp_poly, gaussian_kernel_poly, reciprocal_poly
from crypto.ckks import CKKSParams, TenSEALBackend, make_context
from crypto.data import Sequences, client_transform
from crypto.heval import (
    Evaluator,
    SoftmaxPolys,
    Value,
    gk_attention,
    roll_tokens,
    softmax_attention,
)
from crypto.lora_he import (
    encrypted_steps,
    full_forward,
    full_gradient,
    lora_forward,
    lora_gradient,
    simulate_step,
)
from crypto.model import HEFormer, ModelConfig
from crypto.train import TrainConfig, personalise, pretrain
from defenses.checks import check_int
from defenses.harness import measurement
from defenses.results import Result

FloatArray = npt.NDArray[np.float64]
GK_PARAMS = CKKSParams(8192, (38, 30, 30, 30, 30, 30, 30), 30)
SOFTMAX_PARAMS = CKKSParams(16384, (38, *([30] * 12), 30), 30)
LORA_PARAMS = CKKSParams(8192, (40, 30, 30, 30, 30, 40), 30)


def _int(params: Mapping[str, Any], key: str, default: int) -> int:
    return check_int(f"benchmark parameter {key}", params.get(key, default), 1)


def personalised_model(
    data: Sequences,
    seed: int,
    config: ModelConfig,
    pretrain_epochs: int,
    polish_epochs: int,
    personal: int,
    personal_epochs: int,
) -> tuple[HEFormer, Sequences]:
    """The crypto benchmarks' model for one seed, and the client's data.

    The digit sequences are shuffled by ``seed``: the first 600 are the server's
    public data, the rest (client-transformed) the client's. The model is pretrained
    on the public part (``pretrain_epochs`` exact, ``polish_epochs`` polynomial) and
    personalised on the client's first ``personal`` sequences; later client rows are
    left for the benchmark's batch.
    """
    order = np.random.default_rng(seed).permutation(len(data))
    public = data.subset(order[:600])
    client = client_transform(data.subset(order[600:]))
    g = torch.Generator().manual_seed(seed)
    model = pretrain(
        public,
        config,
        g,
        TrainConfig(epochs=pretrain_epochs, batch=128),
        TrainConfig(epochs=polish_epochs, lr=3e-3, batch=128, penalty=10.0),
    )
    personalise(
        model,
        client.subset(np.arange(personal)),
        g,
        TrainConfig(epochs=personal_epochs, penalty=10.0),
    )
    return model, client


def _exact_attention(
    q: FloatArray, k: FloatArray, v: FloatArray, gk: bool
) -> FloatArray:
    """Float reference per sequence: q, k, v of shape (batch, n, d_h)."""
    if gk:
        dist = ((q[:, :, None, :] - k[:, None, :, :]) ** 2).sum(-1)
        scores = np.exp(-dist / (2 * math.sqrt(q.shape[-1])))
    else:
        logits = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores = scores / scores.sum(-1, keepdims=True)
    out: FloatArray = scores @ v
    return out


def _attention_run(
    kind: str,
    params: CKKSParams,
    q: FloatArray,
    k: FloatArray,
    v: FloatArray,
    interactive: bool,
) -> dict[str, float]:
    import tenseal as ts

    batch, n, dh = q.shape
    start = time.perf_counter()
    ctx = make_context(params)
    keygen = time.perf_counter() - start
    bound = 2.0 * math.sqrt(dh)
    if kind == "gk":
        dist_bound = (
            float(((q[:, :, None] - k[:, None]) ** 2).sum(-1).max()) / bound * 1.25
        )
        qs = q / math.sqrt(bound * dist_bound)
        ks = k / math.sqrt(bound * dist_bound)
        coefficients = gaussian_kernel_poly(dist_bound).coefficients
    else:
        logits = q @ k.transpose(0, 2, 1) / math.sqrt(dh)
        r = float(np.abs(logits).max()) * 1.25
        qs, ks = q / (math.sqrt(dh) * r), k
        sums = np.exp(logits).sum(-1)
        c = 1.0 / (float(sums.max()) * 1.25)
        lo = float(sums.min()) * c / 1.25
        polys = SoftmaxPolys(
            c * exp_poly(r).coefficients, reciprocal_poly(lo).coefficients
        )

    def pack(a: FloatArray, shift: int) -> Value:
        flat = a.reshape(batch * n)
        return Value(ts.ckks_vector(ctx, list(roll_tokens(flat, n, shift))))

    refreshes = [0]

    def refresh(values: list[Value]) -> list[Value]:
        refreshes[0] += 1
        return [Value(ts.ckks_vector(ctx, v.handle.decrypt())) for v in values]

    enc_start = time.perf_counter()
    qv = [pack(qs[:, :, f], 0) for f in range(dh)]
    kv = [[pack(ks[:, :, f], s) for f in range(dh)] for s in range(n)]
    vv = [[pack(v[:, :, f], s) for f in range(dh)] for s in range(n)]
    encrypt = time.perf_counter() - enc_start
    ev = Evaluator(TenSEALBackend(), params.levels, refresh if interactive else None)
    eval_start = time.perf_counter()
    if kind == "gk":
        out = gk_attention(ev, qv, kv, vv, 1, coefficients)
    else:
        out = softmax_attention(ev, qv, kv, vv, 1, polys)
    seconds = time.perf_counter() - eval_start
    got = np.stack([np.asarray(o.handle.decrypt()) for o in out], axis=1).reshape(
        batch, n, dh
    )
    want = _exact_attention(q, k, v, kind == "gk")
    capacity = params.slots // n
    return {
        "eval_s": seconds,
        "ms_per_sequence": 1000 * seconds / capacity,
        "sequences_per_batch": float(capacity),
        "keygen_s": keygen,
        "encrypt_s": encrypt,
        "refresh_rounds": float(ev.counts.get("refresh_rounds", 0)),
        "ct_ct_mul": float(ev.counts.get("ct_ct_mul", 0)),
        "max_error": float(np.max(np.abs(got - want))),
        "levels": float(params.levels),
        "poly_modulus_degree": float(params.poly_modulus_degree),
    }


def attention_benchmark(
    params: Mapping[str, Any], seeds: list[int]
) -> Iterable[Result]:
    """GK vs polynomial-softmax encrypted attention, side by side per seed."""
    n = _int(params, "n_tokens", 8)
    dh = _int(params, "head_dim", 4)
    settings = {"n_tokens": n, "head_dim": dh}
    for seed in seeds:
        rng = np.random.default_rng(seed)
        batch = GK_PARAMS.slots // n
        q, k, v = (rng.standard_normal((batch, n, dh)) * 0.5 for _ in range(3))
        runs = {
            "softmax": _attention_run("softmax", SOFTMAX_PARAMS, q, k, v, False),
            "gk": _attention_run("gk", GK_PARAMS, q, k, v, False),
            "softmax-interactive": _attention_run("softmax", GK_PARAMS, q, k, v, True),
        }
        base = runs["softmax"]["ms_per_sequence"]
        for name, run in runs.items():
            yield measurement(
                "crypto-attention",
                "none" if name == "softmax" else name,
                seed,
                utility={
                    "max_error": run["max_error"],
                    "speedup_vs_softmax": base / run["ms_per_sequence"],
                },
                cost=run,
                params={**settings, "variant": name},
            )


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
    d = _int(params, "d", 16)
    rank = _int(params, "rank", 2)
    tokens = _int(params, "tokens", 256)
    entries = _int(params, "full_gradient_entries", 32)
    steps = _int(params, "sgd_steps", 1)
    sgd_d = _int(params, "sgd_d", 8)
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
