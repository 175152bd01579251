"""The fused numpy steps equal the plain formula bit for bit (issue 42, perf).

The reference below is the DP-SGD step as written before the fusion: per-step
Poisson draws, a sanitized copy of the residuals, ``np.linalg.norm``, the clip
factors with their ``np.where``, the noise drawn and added step by step. It is
independent of :mod:`federated.release`'s fused functions, so a fast path that
drifts from the rule (a row not zeroed, a factor off by one ulp, a draw out of
order) fails here, on inputs that include NaN and inf residual rows (crafted
weights), zero-norm rows, integer, float32 and Fortran-ordered features.
"""

import json
import logging

import numpy as np
import pytest

from defense_suite.federated.client import (
    LocalData,
    StepPlan,
    batches,
    local_train,
    local_train_clients,
    poisson_batch,
    predict_proba,
)
from defense_suite.federated.release import add_noise, clip_rows, fp_quiet
from tests.federated.same_records import compare


def _plain_clip(rows, scale, clip):
    """The release rule before the fusion: sanitize (a non-finite row is zero),
    then scale each row by min(1, C / norm), or 0 where that is not finite."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        clean = rows.copy()
        clean[~np.isfinite(clean).all(axis=1)] = 0.0
        norms = np.linalg.norm(clean, axis=1) * scale
        factor = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
        factor = np.where(np.isfinite(norms) & np.isfinite(factor), factor, 0.0)
        return clean * factor[:, None]


def _plain_step(W, b, X, y, clip, mask=None):
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        z = X @ W + b
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        residual = e / e.sum(axis=1, keepdims=True)
        residual[np.arange(y.size), y] -= 1.0
        if clip is not None:
            residual = _plain_clip(residual, np.sqrt((X * X).sum(axis=1) + 1.0), clip)
        if mask is not None:
            residual *= mask[:, None]
        return X.T @ residual, residual.sum(axis=0)


def _plain_round(params, data, plan, lr, clip, rng, count, constant_work, fixed):
    """The pre-fusion local round (softmax), returning the raw weights."""
    W, b = params[0].copy(), params[1].copy()
    n = len(data)
    if fixed:
        size = max(1, round(plan.rate * n))
        draws = [np.arange(s * size, (s + 1) * size) % n for s in range(plan.steps)]
    else:
        draws = [poisson_batch(rng, n, plan.rate) for _ in range(plan.steps)]
    for index in draws:
        if plan.sigma is None:
            if index.size == 0:
                continue
            gW, gb = _plain_step(W, b, data.X[index], data.y[index], None)
            W -= lr * gW / index.size
            b -= lr * gb / index.size
            continue
        if constant_work:
            mask = np.zeros(n)
            mask[index] = 1.0
            gW, gb = _plain_step(W, b, data.X, data.y, clip, mask)
        else:
            gW, gb = _plain_step(W, b, data.X[index], data.y[index], clip)
        total = np.concatenate([gW.ravel(), gb])
        noise = rng.normal(0.0, plan.sigma * clip, size=total.shape)
        with np.errstate(over="ignore", invalid="ignore"):
            noised = total + noise
            if not np.isfinite(noised).all():
                noised = noise
            flat = noised / (plan.rate * count)
            W -= lr * flat[: W.size].reshape(W.shape)
            b -= lr * flat[W.size :]
    return [W, b]


def _case(seed):
    """Random client, weights and plan; some rows overflow or have zero norm."""
    r = np.random.default_rng(seed)
    n, d, k = int(r.integers(1, 40)), int(r.integers(1, 7)), int(r.integers(2, 6))
    X = r.normal(size=(n, d)) * 10 ** r.uniform(-1, 1)
    if seed % 4 == 1:
        X = r.integers(-3, 4, size=(n, d))
    elif seed % 4 == 2:
        X = np.asfortranarray(X)
    elif seed % 8 == 7:
        X = X.astype(np.float32)
    y = r.integers(0, k, n)
    W, b = r.normal(size=(d, k)), r.normal(size=k)
    if seed % 3 == 0:  # margins of 1e4: exact one-hot probabilities, zero-norm rows
        W *= 1e4
    if seed % 5 == 0:  # crafted weights: NaN / inf residual rows
        W[0, 0] = [np.inf, np.nan, 1e308, -1e308, 1e300][seed % 4]
    sigma = [None, 1.0, 0.3, 1e-12][seed % 4] if seed % 7 else 2.0
    plan = StepPlan(float(r.uniform(0.05, 1.0)), int(r.integers(1, 5)), sigma)
    lr, clip = float(r.uniform(0.1, 4.0)), float(r.uniform(0.1, 2.0))
    return LocalData(X, y, k), [W, b], plan, lr, clip, int(r.integers(1, 100))


def _bits(arrays):
    return [np.asarray(a).tobytes() for a in arrays]


@pytest.mark.parametrize("constant_work", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_local_train_equals_the_plain_formula_bit_for_bit(seed, constant_work):
    data, params, plan, lr, clip, count = _case(seed)
    fixed = seed % 11 == 3
    sampling = "fixed" if fixed else "poisson"
    logging.disable(logging.CRITICAL)
    try:
        fast = local_train(
            params, data, plan, lr=lr, clip=clip, rng=np.random.default_rng(seed),
            sampling=sampling, public_count=count, constant_work=constant_work,
        )  # fmt: skip
    except ValueError:  # a diverged non-private round: the plain one diverged too
        fast = None
    finally:
        logging.disable(logging.NOTSET)
    plain = _plain_round(
        params, data, plan, lr, clip, np.random.default_rng(seed), count,
        constant_work, fixed,
    )  # fmt: skip
    if fast is None:
        assert plan.sigma is None
        assert not all(np.isfinite(p).all() for p in plain)
        return
    if plan.sigma is not None:
        plain = [np.nan_to_num(p) for p in plain]  # finite_release
    assert _bits(fast) == _bits(plain)


def test_the_cases_reach_nonfinite_and_zero_norm_rows():
    """The inputs above do exercise the rule's corners (else the test is weak)."""
    nonfinite = zero = 0
    for seed in range(40):
        data, (W, b), *_ = _case(seed)
        with fp_quiet():
            z = data.X @ W + b
            p = np.exp(z - z.max(axis=1, keepdims=True))
            r = p / p.sum(axis=1, keepdims=True)
            r[np.arange(len(data)), data.y] -= 1.0
        nonfinite += int((~np.isfinite(r).all(axis=1)).sum())
        zero += int((np.abs(r).sum(axis=1) == 0).sum())
    assert nonfinite > 10
    assert zero > 10


@pytest.mark.parametrize("seed", range(30))
def test_clip_rows_is_the_plain_sanitize_then_clip(seed):
    r = np.random.default_rng(seed)
    rows = r.normal(size=(int(r.integers(0, 30)), 5)) * 10 ** r.uniform(-3, 3)
    picks = r.random((4, rows.shape[0])) < 0.15
    rows[picks[0], 0] = np.nan
    rows[picks[1], -1] = -np.inf
    rows[picks[2]] = 0.0
    rows[picks[3], 1] = 1e200  # finite, but the squared norm overflows
    scale = r.uniform(1.0, 5.0, size=rows.shape[0])
    expected = _plain_clip(rows, scale, 0.7)
    with fp_quiet():
        got = clip_rows(rows.copy(), scale, 0.7)
    np.testing.assert_array_equal(got, expected)  # equal up to the sign of zeros
    assert np.isfinite(got).all()
    assert np.all(np.sqrt((got * got).sum(axis=1)) * scale <= 0.7 * (1 + 1e-12))
    kept = ~picks.any(axis=0)
    assert _bits(got[kept]) == _bits(expected[kept])


def test_add_noise_replaces_only_the_nonfinite_release(caplog):
    total = np.array([[1.0, 2.0], [np.inf, 0.0], [3.0, -1.0]])
    noise = np.array([[0.5, 0.5], [0.25, -0.25], [1e308, 1e308]])
    with fp_quiet(), caplog.at_level(logging.ERROR):
        add_noise(total, noise)
    assert total.tolist() == [[1.5, 2.5], [0.25, -0.25], [1e308, 1e308]]
    assert "noise alone" in caplog.text


def test_bulk_poisson_draws_are_the_step_by_step_draws():
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    bulk = batches(a, 57, 0.2, 5, "poisson")
    steps = [poisson_batch(b, 57, 0.2) for _ in range(5)]
    assert [x.tolist() for x in bulk] == [x.tolist() for x in steps]
    assert a.random() == b.random()  # the streams end at the same place


@pytest.mark.parametrize("seed", range(6))
def test_clients_in_lockstep_equal_each_client_alone(seed):
    r = np.random.default_rng(seed)
    d, k, count = 4, 3, 5
    clients = [
        LocalData(r.normal(size=(n, d)), r.integers(0, k, n), k)
        for n in r.integers(1, 30, count)
    ]
    W, b = r.normal(size=(d, k)) * (1e4 if seed == 2 else 1.0), r.normal(size=k)
    if seed == 3:
        W[1, 1] = np.inf
    plans = [
        StepPlan(0.1 + 0.15 * c, 1 + (c + seed) % 4, None if seed == 4 else 1.0 + c)
        for c in range(count)
    ]
    if seed == 5:  # private and non-private clients in one round
        plans[1] = StepPlan(0.5, 3, None)
    lrs = [0.5 + c for c in range(count)]
    logging.disable(logging.CRITICAL)
    try:
        together = local_train_clients(
            [W, b], clients, plans, lrs=lrs, clip=0.8,
            rngs=[np.random.default_rng([seed, c]) for c in range(count)],
        )  # fmt: skip
        alone = [
            local_train(
                [W, b],
                data,
                plan,
                lr=lr,
                clip=0.8,
                rng=np.random.default_rng([seed, c]),
                constant_work=False,
            )
            for c, (data, plan, lr) in enumerate(zip(clients, plans, lrs, strict=True))
        ]
    finally:
        logging.disable(logging.NOTSET)
    assert [_bits(p) for p in together] == [_bits(p) for p in alone]


def test_same_records_sees_one_ulp_and_skips_run_times(tmp_path):
    record = {"utility": {"accuracy": 0.75}, "cost": {"fit_s": 1.0, "queries": 3}}
    moved = {
        "utility": {"accuracy": np.nextafter(0.75, 1.0)},
        "cost": {"fit_s": 2.0, "queries": 3},
    }
    timed = {"utility": {"accuracy": 0.75}, "cost": {"fit_s": 9.0, "queries": 3}}
    paths = []
    for name, rec in (("a", record), ("b", moved), ("c", timed)):
        paths.append(tmp_path / f"{name}.jsonl")
        paths[-1].write_text(json.dumps(rec) + "\n")
    assert compare(paths[0], paths[2]) == []
    assert compare(paths[0], paths[1]) == [
        "record 0.utility.accuracy: 0.75 != 0.7500000000000001"
    ]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64])
def test_predict_proba_is_the_plain_softmax_in_the_logits_type(dtype):
    r = np.random.default_rng(1)
    X = (r.normal(size=(9, 4)) * 3).astype(dtype)
    W, b = (r.normal(size=(4, 3)) * 2).astype(dtype), r.normal(size=3).astype(dtype)
    z = X @ W + b
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    plain = np.asarray(e / e.sum(axis=1, keepdims=True), dtype=np.float64)
    got = predict_proba([W, b], X)
    assert got.dtype == np.float64
    assert got.tobytes() == plain.tobytes()
