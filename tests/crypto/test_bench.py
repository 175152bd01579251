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
from defense_suite.crypto.figures import figures
from defense_suite.crypto.he.approx import (
    exp_poly,
    gaussian_kernel_poly,
    reciprocal_poly,
)
from defense_suite.crypto.he.ckks import CKKSParams, make_context
from defense_suite.crypto.he.evaluator import DepthError, Evaluator, NumpyBackend, Value
from defense_suite.crypto.he.packing import roll_tokens
from defense_suite.crypto.program.heformer import (
    SoftmaxPolys,
    gk_attention,
    softmax_attention,
)
from defense_suite.crypto.program.lora_he import (
    encrypted_steps,
    full_forward,
    lora_forward,
    simulate_step,
)
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


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 1000))
def test_sgd_step_is_the_gradient(seed: int) -> None:
    rng = np.random.default_rng(seed)
    X, Y = rng.standard_normal((6, 3)), rng.standard_normal((6, 3))
    W0, A, B = (
        rng.standard_normal((3, 3)),
        rng.standard_normal((3, 2)),
        rng.standard_normal((2, 3)),
    )

    def loss(a: np.ndarray, b: np.ndarray) -> float:
        return 0.5 * float(np.mean(np.sum((X @ (W0 + a @ b) - Y) ** 2, axis=1)))

    lr = 1e-6
    new_a, _ = simulate_step(X, Y, W0, A, B, lr)
    eps = 1e-6
    e = np.zeros_like(A)
    e[1, 0] = eps
    numeric = (loss(A + e, B) - loss(A - e, B)) / (2 * eps)
    assert math.isclose((A - new_a)[1, 0] / lr, numeric, rel_tol=1e-4, abs_tol=1e-6)


def test_encrypted_lora_step_matches_simulation() -> None:
    rng = np.random.default_rng(0)
    T, d, r = 16, 2, 1
    X, Y = rng.standard_normal((T, d)) * 0.3, rng.standard_normal((T, d)) * 0.3
    W0, A, B = (
        rng.standard_normal((d, d)),
        rng.standard_normal((d, r)),
        rng.standard_normal((r, d)),
    )
    ctx = make_context(CKKSParams(8192, (40, 30, 30, 30, 30, 40), 30), galois=True)
    enc_a, enc_b, rounds = encrypted_steps(ctx, X, Y, W0, A, B, 0.5, 2)
    sim_a, sim_b = A, B
    for _ in range(2):
        sim_a, sim_b = simulate_step(X, Y, W0, sim_a, sim_b, 0.5)
    assert rounds == 2
    assert np.max(np.abs(enc_a - sim_a)) < 1e-2
    assert np.max(np.abs(enc_b - sim_b)) < 1e-2
    assert np.max(np.abs(sim_a - A)) > 0.01
    with pytest.raises(ValueError, match="power of two"):
        encrypted_steps(ctx, X[:6], Y[:6], W0, A, B, 0.05, 1)


def test_full_and_lora_forward_agree() -> None:
    import tenseal as ts

    rng = np.random.default_rng(0)
    ctx = make_context(CKKSParams(8192, (40, 30, 30, 30, 30, 40), 30))
    X = rng.standard_normal((8, 2))
    W0, A, B = (
        rng.standard_normal((2, 2)),
        rng.standard_normal((2, 1)),
        rng.standard_normal((1, 2)),
    )
    x = [ts.ckks_vector(ctx, list(X[:, g])) for g in range(2)]

    def rep(M: np.ndarray) -> list[list[object]]:
        return [[ts.ckks_vector(ctx, [float(m)] * 8) for m in row] for row in M]

    full = full_forward(x, rep(W0 + A @ B))
    lora, _ = lora_forward(x, W0, rep(A), rep(B))
    want = X @ (W0 + A @ B)
    for f in range(2):
        assert np.allclose(full[f].decrypt(), want[:, f], atol=1e-3)
        assert np.allclose(lora[f].decrypt(), want[:, f], atol=1e-3)


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
