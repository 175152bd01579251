from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from defense_suite.crypto.benchmark.attention import (
    _exact_attention,
    attention_benchmark,
)
from defense_suite.crypto.benchmark.lora import lora_benchmark
from defense_suite.crypto.figures import figures
from defense_suite.crypto.he.approx import (
    exp_poly,
    gaussian_kernel_poly,
    reciprocal_poly,
)
from defense_suite.crypto.he.ckks import (
    CKKSParams,
    TenSEALBackend,
    local_key_owner,
)
from defense_suite.crypto.he.evaluator import DepthError, Evaluator, NumpyBackend, Value
from defense_suite.crypto.he.packing import roll_tokens, unit
from defense_suite.crypto.program import lora_he
from defense_suite.crypto.program.heformer import (
    SoftmaxPolys,
    gk_attention,
    softmax_attention,
)
from defense_suite.crypto.program.lora_he import Regression
from defenses.harness import measurement


def _rolled(rng: np.random.Generator, batch: int = 16, n: int = 4, dh: int = 4):
    q, k, v = (rng.standard_normal((batch, n, dh)) * 0.5 for _ in range(3))

    def pack(a: np.ndarray, s: int) -> Value:
        return Value(roll_tokens(a.reshape(-1), n, s))

    return q, k, v, pack


def test_gk_attention_layout_matches_exact() -> None:
    q, k, v, pack = _rolled(np.random.default_rng(0))
    n, dh = 4, 4
    bound = 2 * math.sqrt(dh)
    dmax = float(((q[:, :, None] - k[:, None]) ** 2).sum(-1).max()) / bound * 1.25
    c = 1 / math.sqrt(bound * dmax)
    ev = Evaluator(NumpyBackend(), 5)
    out = gk_attention(
        ev,
        [pack(q[:, :, f] * c, 0) for f in range(dh)],
        [[pack(k[:, :, f] * c, s) for f in range(dh)] for s in range(n)],
        [[pack(v[:, :, f], s) for f in range(dh)] for s in range(n)],
        1,
        gaussian_kernel_poly(dmax).coefficients,
    )
    got = np.stack([o.handle for o in out], 1).reshape(q.shape)
    assert np.max(np.abs(got - _exact_attention(q, k, v, True))) < 2e-3
    assert max(o.level for o in out) == 5


def test_softmax_needs_eleven_levels() -> None:
    q, k, v, pack = _rolled(np.random.default_rng(1))
    n, dh = 4, 4
    logits = q @ k.transpose(0, 2, 1) / 2
    r = float(np.abs(logits).max()) * 1.25
    sums = np.exp(logits).sum(-1)
    c = 1 / (sums.max() * 1.25)
    polys = SoftmaxPolys(
        c * exp_poly(r).coefficients,
        reciprocal_poly(sums.min() * c / 1.25).coefficients,
    )
    args = (
        [pack(q[:, :, f] / (2 * r), 0) for f in range(dh)],
        [[pack(k[:, :, f], s) for f in range(dh)] for s in range(n)],
        [[pack(v[:, :, f], s) for f in range(dh)] for s in range(n)],
        1,
        polys,
    )
    with pytest.raises(DepthError, match="non-interactive"):
        softmax_attention(Evaluator(NumpyBackend(), 10), *args)
    out = softmax_attention(Evaluator(NumpyBackend(), 11), *args)
    got = np.stack([o.handle for o in out], 1).reshape(q.shape)
    assert np.max(np.abs(got - _exact_attention(q, k, v, False))) < 0.05


def _layer(
    rng: np.random.Generator, d: int, r: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random frozen ``d x d`` weight and rank-``r`` factors A, B."""
    return (
        rng.standard_normal((d, d)),
        rng.standard_normal((d, r)),
        rng.standard_normal((r, d)),
    )


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 1000))
def test_sgd_step_is_the_gradient(seed: int) -> None:
    rng = np.random.default_rng(seed)
    X, Y = rng.standard_normal((6, 3)), rng.standard_normal((6, 3))
    W0, A, B = _layer(rng, 3, 2)

    def loss(a: np.ndarray, b: np.ndarray) -> float:
        return 0.5 * float(np.mean(np.sum((X @ (W0 + a @ b) - Y) ** 2, axis=1)))

    lr = 1e-6
    new_a, _ = Regression(X, Y, W0).step(A, B, lr)
    eps = 1e-6
    e = np.zeros_like(A)
    e[1, 0] = eps
    numeric = (loss(A + e, B) - loss(A - e, B)) / (2 * eps)
    assert math.isclose((A - new_a)[1, 0] / lr, numeric, rel_tol=1e-4, abs_tol=1e-6)


def test_encrypted_lora_step_matches_simulation() -> None:
    rng = np.random.default_rng(0)
    T, d, r = 16, 2, 1
    X, Y = rng.standard_normal((T, d)) * 0.3, rng.standard_normal((T, d)) * 0.3
    W0, A, B = _layer(rng, d, r)
    params = CKKSParams(8192, (40, 30, 30, 30, 30, 40), 30)
    task = Regression(X, Y, W0)
    enc_a, enc_b, rounds = lora_he.encrypted_steps(params, task, A, B, 0.5, 2)
    sim_a, sim_b = A, B
    for _ in range(2):
        sim_a, sim_b = task.step(sim_a, sim_b, 0.5)
    assert rounds == 2
    assert np.max(np.abs(enc_a - sim_a)) < 1e-2
    assert np.max(np.abs(enc_b - sim_b)) < 1e-2
    assert np.max(np.abs(sim_a - A)) > 0.01
    with pytest.raises(ValueError, match="power of two"):
        lora_he.encrypted_steps(params, Regression(X[:6], Y[:6], W0), A, B, 0.05, 1)


def test_full_and_lora_forward_agree() -> None:
    params = CKKSParams(8192, (40, 30, 30, 30, 30, 40), 30)
    encrypt, decrypt = local_key_owner(params, galois=False)
    ev = Evaluator(TenSEALBackend(), params.levels)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((8, 2))
    W0, A, B = _layer(rng, 2, 1)
    x = [Value(encrypt(col)) for col in X.T]

    def rep(M: np.ndarray) -> list[list[Value]]:
        return unit(lambda m: encrypt(np.full(8, m)), M)

    full = lora_he.full_forward(ev, x, rep(W0 + A @ B))
    Ae, Be = lora_he.encrypted_factors(ev, lambda m: encrypt(np.full(8, m)), A, B)
    assert [v.level for row in Ae + Be for v in row] == [0, 0, 1, 1]
    lora, xa = lora_he.lora_forward(ev, x, W0, Ae, Be)
    want = X @ (W0 + A @ B)
    for f in range(2):
        assert np.allclose(decrypt(full[f].handle), want[:, f], atol=1e-3)
        assert np.allclose(decrypt(lora[f].handle), want[:, f], atol=1e-3)
    assert np.allclose(decrypt(xa[0].handle), (X @ A)[:, 0], atol=1e-3)
    # the evaluator tracks the levels: one product for x A and W0, B met at level 1
    assert [v.level for v in full] == [1, 1]
    assert [v.level for v in lora] == [2, 2]
    assert ev.counts["ct_ct_mul"] == 4 + 2 + 2


def test_layer_gradients_are_the_closed_form() -> None:
    """The one-layer gradients on the float64 backend equal the matrix formulas."""
    rng = np.random.default_rng(3)
    T, d, r = 8, 3, 2
    X, G = rng.standard_normal((T, d)), rng.standard_normal((T, d))
    W0, A, B = _layer(rng, d, r)
    ev = Evaluator(NumpyBackend(), 4)
    x, grad = [Value(c) for c in X.T], [Value(c) for c in G.T]
    y, xa = lora_he.lora_forward(ev, x, W0, unit(float, A), unit(float, B))
    grad_a, grad_b = lora_he.lora_gradient(ev, x, xa, grad, unit(float, B))

    def first(sums: list[list[Value]]) -> np.ndarray:
        return np.array([[np.ravel(v.handle)[0] for v in row] for row in sums])

    assert np.allclose(np.array([v.handle for v in y]).T, X @ (W0 + A @ B))
    assert np.allclose(first(grad_a), X.T @ (G @ B.T))
    assert np.allclose(first(grad_b), (X @ A).T @ G)
    pairs = [(0, 2), (2, 1)]
    sums = lora_he.full_gradient(ev, x, grad, pairs)
    assert np.allclose(first([sums])[0], [(X.T @ G)[g, f] for g, f in pairs])


def test_lora_benchmark_counts_what_it_times() -> None:
    """The records' operation counts are the layer's: d^2 vs 3dr products."""
    d, r = 4, 2
    params = {"d": d, "rank": r, "tokens": 16, "full_gradient_entries": 8}
    records = {
        rec.defense: rec
        for rec in lora_benchmark(params | {"sgd_d": 2, "sgd_steps": 1}, [0])
    }
    full, lora = records["none"].cost, records["lora"].cost
    assert full["gradient_ct_ct_mul"] == full["gradient_slot_sums"] == d * d
    assert lora["gradient_ct_ct_mul"] == 3 * d * r
    assert lora["gradient_slot_sums"] == 2 * d * r
    assert full["encrypted_weights"] == d * d
    assert lora["encrypted_weights"] == 2 * d * r
    assert max(full["max_error"], lora["max_error"]) < 1e-2
    utility = records["lora"].utility
    assert utility["sgd_step_diff"] < 1e-3 < utility["sgd_update_size"]
    assert records["none"].utility["gradient_speedup"] == 1.0


def test_benchmark_bad_params() -> None:
    with pytest.raises(ValueError, match="n_tokens"):
        list(attention_benchmark({"n_tokens": 0}, [0]))


def test_figures(tmp_path: Path) -> None:
    results = [
        measurement(
            "crypto-attention",
            name,
            0,
            cost={"ms_per_sequence": ms},
            params={"variant": name},
        )
        for name, ms in (("none", 10.0), ("gk", 2.0))
    ]
    results = [
        type(r)(**{**r.to_dict(), "meta": {"spec": "crypto_attention-quick"}})
        for r in results
    ]
    made = figures(results, tmp_path)
    assert len(made) == 1
    assert made[0][1].exists()
    assert made[0][1].stat().st_size > 1000
