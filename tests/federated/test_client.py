import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from defense_suite.federated.client import (
    LocalData,
    StepPlan,
    fixed_batches,
    init_params,
    local_train,
    poisson_batch,
    predict_proba,
    privatize,
    record_inclusion,
)
from defense_suite.federated.softmax import softmax_step


def clip_rows(grads, clip):
    norms = np.linalg.norm(grads, axis=1, keepdims=True)
    return grads * np.minimum(1.0, clip / np.maximum(norms, 1e-300))


def _softmax_grads(params, X, y):
    """Reference: explicit per-example gradients, flattened (W then b)."""
    residual = predict_proba(params, X)
    residual[np.arange(y.size), y] -= 1.0
    weight = np.einsum("bd,bk->bdk", X, residual).reshape(y.size, -1)
    return np.concatenate([weight, residual], axis=1)


def _data(n=40, d=5, k=3, seed=0):
    rng = np.random.default_rng(seed)
    return LocalData(rng.normal(size=(n, d)), rng.integers(0, k, n).astype(np.int64), k)


@settings(max_examples=25, deadline=None)
@given(
    arrays(np.float64, (6, 4), elements=st.floats(-30, 30)),
    st.floats(0.05, 10.0),
)
def test_fast_clipped_sum_equals_explicit_per_example_clipping(X, clip):
    y = np.array([0, 1, 2, 0, 1, 2])
    params = [np.linspace(-1, 1, 12).reshape(4, 3), np.array([0.1, -0.2, 0.3])]
    reference = clip_rows(_softmax_grads(params, X, y), clip).sum(axis=0)
    gW, gb = softmax_step(params[0], params[1], X, y, clip)
    np.testing.assert_allclose(np.concatenate([gW.ravel(), gb]), reference, atol=1e-9)
    clipped = clip_rows(_softmax_grads(params, X, y), clip)
    assert np.all(np.linalg.norm(clipped, axis=1) <= clip * (1 + 1e-9))


def test_softmax_gradients_match_finite_differences():
    data = _data(n=3)
    params = init_params("softmax", 5, 3, 8, np.random.default_rng(1))
    params = [p + 0.1 for p in params]
    grads = _softmax_grads(params, data.X, data.y)

    def loss(W, b, i):
        p = predict_proba([W, b], data.X[i : i + 1])
        return -np.log(p[0, data.y[i]])

    eps = 1e-6
    for i in range(3):
        W = params[0].copy()
        W[2, 1] += eps
        numeric = (loss(W, params[1], i) - loss(params[0], params[1], i)) / eps
        assert grads[i, 2 * 3 + 1] == pytest.approx(numeric, abs=1e-4)


def test_poisson_batch_rate_and_fixed_batches():
    rng = np.random.default_rng(0)
    sizes = [poisson_batch(rng, 1000, 0.1).size for _ in range(200)]
    assert np.mean(sizes) == pytest.approx(100, rel=0.05)
    batches = fixed_batches(10, 0.3, 4)
    assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]
    inc = record_inclusion(rng, 5000, 10, 0.2, 3, "poisson")
    assert inc.mean() == pytest.approx(0.2, abs=0.02)
    fixed = record_inclusion(rng, 2, 10, 0.3, 4, "fixed")
    assert fixed.tolist() == [[True, False, False, True]] * 2


def test_privatize_noise_scale():
    rng = np.random.default_rng(0)
    out = privatize(np.zeros(20000), 2.0, 0.5, 4.0, rng)
    assert out.std() == pytest.approx(2.0 * 0.5 / 4.0, rel=0.03)


@pytest.mark.parametrize("model", ["softmax", "mlp"])
@pytest.mark.parametrize("sigma", [None, 1.0])
def test_local_train_is_deterministic_and_moves(model, sigma):
    data = _data()
    params = init_params(model, 5, 3, 8, np.random.default_rng(0))
    plan = StepPlan(0.3, 3, sigma)
    a = local_train(params, data, plan, lr=0.1, clip=1.0, rng=np.random.default_rng(7))
    b = local_train(params, data, plan, lr=0.1, clip=1.0, rng=np.random.default_rng(7))
    for x, y, p in zip(a, b, params, strict=True):
        np.testing.assert_array_equal(x, y)
        assert x.shape == p.shape
    assert any(not np.array_equal(x, p) for x, p in zip(a, params, strict=True))


def test_mlp_without_noise_follows_clipped_sgd():
    # sigma -> tiny: Opacus's step equals the numpy reference of clipped SGD.
    data = _data(n=6)
    params = init_params("mlp", 5, 3, 4, np.random.default_rng(0))
    plan = StepPlan(1.0, 1, 1e-12)
    out = local_train(
        params, data, plan, lr=0.1, clip=1e3, rng=np.random.default_rng(0)
    )
    sgd = local_train(
        params,
        data,
        StepPlan(1.0, 1, None),
        lr=0.1,
        clip=1.0,
        rng=np.random.default_rng(0),
    )
    for x, y in zip(out, sgd, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_bad_client_inputs():
    with pytest.raises(ValueError, match="no data"):
        LocalData(np.zeros((0, 3)), np.zeros(0, np.int64), 2)
    with pytest.raises(ValueError, match="NaN"):
        LocalData(np.full((2, 3), np.nan), np.zeros(2, np.int64), 2)
    with pytest.raises(ValueError, match="labels"):
        LocalData(np.zeros((2, 3)), np.array([0, 5]), 2)
    with pytest.raises(ValueError, match="rate"):
        StepPlan(0.0, 1, 1.0)
    with pytest.raises(ValueError, match="sigma"):
        StepPlan(0.5, 1, -1.0)
    params = init_params("softmax", 5, 3, 8, np.random.default_rng(0))
    with pytest.raises(ValueError, match="sampling"):
        local_train(
            params,
            _data(),
            StepPlan(0.5, 1, 1.0),
            lr=0.1,
            clip=1.0,
            rng=np.random.default_rng(0),
            sampling="shuffle",
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lr"):
        local_train(
            params,
            _data(),
            StepPlan(0.5, 1, 1.0),
            lr=-1.0,
            clip=1.0,
            rng=np.random.default_rng(0),
        )
    with pytest.raises(ValueError, match="2 \\(softmax\\) or 4"):
        local_train(
            params[:1],
            _data(),
            StepPlan(0.5, 1, 1.0),
            lr=0.1,
            clip=1.0,
            rng=np.random.default_rng(0),
        )
