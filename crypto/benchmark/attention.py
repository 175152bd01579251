"""Benchmark ``crypto-attention``: encrypted attention, Gaussian kernel vs softmax.

One encrypted attention head over rolled copies, Gaussian kernel versus polynomial
softmax (Rho et al., 2025, report 2.3x faster inference). Each variant runs in the
smallest ring that evaluates it without refreshes (the non-interactive
configuration): GK needs 5 levels (N = 8192), softmax 11 (N = 16384, a chain of 12).
The interactive softmax (N = 8192 with client-aided refreshes) is measured too.
Latency per sequence is the batch time divided by the ring's capacity (N/2 / n
sequences), since a ciphertext costs the same however many of its slots are used.
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

from ..he.approx import exp_poly, gaussian_kernel_poly, reciprocal_poly
from ..he.ckks import CKKSParams, TenSEALBackend, make_context
from ..he.evaluator import Evaluator, Value
from ..he.packing import roll_tokens
from ..program.heformer import SoftmaxPolys, gk_attention, softmax_attention

GK_PARAMS = CKKSParams(8192, (38, 30, 30, 30, 30, 30, 30), 30)
SOFTMAX_PARAMS = CKKSParams(16384, (38, *([30] * 12), 30), 30)


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
    n = int_param(params, "n_tokens", 8)
    dh = int_param(params, "head_dim", 4)
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
