"""The bad-input rule on SSD's public entry points, by property, and its regressions.

Every call either returns a valid answer (finite, the right shape, rows on the
simplex) or raises ValueError/TypeError naming the parameter
(:func:`defenses.testing.assert_rule`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from defenses.ssd.defense import StealthyShield
from defenses.ssd.seeding import input_keys
from defenses.ssd.waterfill import water_filling
from defenses.testing import (
    assert_rule,
    bad_arrays,
    bad_reals,
    probability_rows,
    rule_settings,
)

K = 4
VAL = np.random.default_rng(0).dirichlet(np.ones(K), 40)
LABELS = np.arange(40) % K
PARAMS = ("epsilon", "temperature", "hash_resolution", "seed", "n_threads")


def _fitted(**kwargs) -> StealthyShield:
    return StealthyShield(seed=0, **kwargs).fit(VAL, LABELS)


def _rows(n: int | None = None, k: int = K):
    def valid(out) -> None:
        out = out.numpy() if isinstance(out, torch.Tensor) else np.asarray(out)
        assert out.ndim == 2
        assert out.shape[1] == k
        if n is not None:
            assert out.shape[0] == n
        assert (out >= 0).all()
        np.testing.assert_allclose(out.astype(np.float64).sum(axis=1), 1.0, atol=2e-3)

    return valid


@pytest.mark.filterwarnings("ignore:epsilon=.* is far above:UserWarning")
@rule_settings(20)
@given(name=st.sampled_from(PARAMS), value=bad_reals())
def test_constructor_parameters(name, value):
    kwargs = {name: value}
    if name == "hash_resolution":
        kwargs["seeding"] = "input-hash"

    def call():
        return _fitted(**kwargs)(VAL[:5])

    assert_rule(call, [name], _rows(5))


@rule_settings(20)
@given(probs=probability_rows(6, K), hashed=st.booleans())
def test_call_on_probability_rows(probs, hashed):
    shield = _fitted(seeding="input-hash" if hashed else "random")
    n = probs.shape[0] if probs.ndim == 2 else None
    assert_rule(lambda: shield(probs), ["probs"], _rows(n))
    assert_rule(lambda: shield.predict_label(probs), ["probs"])


@rule_settings(20)
@given(probs=bad_arrays((5, K)))
def test_call_on_bad_arrays(probs):
    shield = _fitted()
    assert_rule(lambda: shield(probs), ["probs"], _rows())
    assert_rule(lambda: shield(torch.from_numpy(probs)), ["probs"], _rows())


@rule_settings(20)
@given(val=bad_arrays((12, K)), labels=bad_arrays((12,)))
def test_fit_on_bad_arrays(val, labels):
    def call():
        return StealthyShield(seed=0).fit(val, labels)(VAL[:3])

    assert_rule(call, ["val_probs", "val_labels"], _rows(3))


@rule_settings(20)
@given(inputs=bad_arrays((6, 3)))
def test_hash_inputs(inputs):
    shield = _fitted(seeding="input-hash", hash_resolution=0.1)
    assert_rule(lambda: shield(VAL[:6], inputs=inputs), ["inputs"], _rows(6))


@rule_settings(20)
@given(f=bad_arrays((5, K)), budget=bad_arrays((5,)))
def test_water_filling(f, budget):
    q = VAL[:5]
    assert_rule(lambda: water_filling(f, q, budget), ["f", "q", "budget"], _rows(5))


# --- the cases --------------------------------------------------------------


def test_subnormal_temperature_draws_the_arg_max():
    shield = _fitted(temperature=1e-320, epsilon=2.0)
    probs = np.random.default_rng(1).dirichlet(np.ones(K), 200)
    labels = shield.pseudo_labels(probs)
    np.testing.assert_array_equal(labels, probs.argmax(axis=1))
    sampling = shield.sampling_probs(probs)
    assert np.isfinite(sampling).all()
    np.testing.assert_array_equal(sampling.argmax(axis=1), probs.argmax(axis=1))
    assert np.isfinite(shield(probs)).all()


@pytest.mark.parametrize("k", [4, 40])
def test_subnormal_temperature_splits_tied_maxima(k):
    # 1/T overflows at T = 1e-320; the kernels multiply by min(1/T, 1e300), so a
    # largest entry's weight is exp(0 * 1e300) = 1 and tied maxima share the draw
    # (an uncapped inf gives 0 * inf = NaN, weight 0, and always the first maximum)
    val = np.random.default_rng(0).dirichlet(np.ones(k), 2 * k)
    shield = StealthyShield(seed=0, temperature=1e-320, epsilon=2.0)
    shield.fit(val, np.arange(2 * k) % k)
    probs = np.full((2000, k), 0.2 / (k - 2))
    probs[:, 1] = probs[:, k - 1] = 0.4
    counts = np.bincount(shield.pseudo_labels(probs), minlength=k)
    assert counts[1] + counts[k - 1] == 2000
    assert min(counts[1], counts[k - 1]) > 800


def test_complex_input_is_refused_not_truncated():
    shield = _fitted()
    with pytest.raises(TypeError, match="probs must be real"):
        shield(VAL[:3].astype(np.complex128))
    with pytest.raises(TypeError, match="probs must be real"):
        shield(torch.from_numpy(VAL[:3]).to(torch.complex128))
    with pytest.raises(ValueError, match="real"):
        water_filling(VAL[:3].astype(np.complex128), VAL[:3], np.ones(3))


def test_float16_softmax_is_judged_by_float16_rounding():
    logits = np.random.default_rng(2).normal(size=(50, 100))
    probs = torch.softmax(torch.from_numpy(logits).half(), dim=1)
    assert float((probs.double().sum(1) - 1).abs().max()) > 1e-4
    shield = StealthyShield(seed=0).fit(
        np.random.default_rng(3).dirichlet(np.ones(100), 300), np.arange(300) % 100
    )
    answers = shield(probs)
    assert answers.dtype == torch.float16
    assert bool(torch.isfinite(answers).all())
    assert shield(probs.numpy()).dtype == np.float16


def test_hash_resolution_tells_nan_inf_and_huge_apart():
    inputs = np.array([[np.nan], [np.inf], [-np.inf], [1e300], [3e300], [1.0]])
    keys = input_keys(inputs, 6, 1e-3)
    assert len(set(keys)) == 6


def test_numpy_scalars_are_accepted():
    shield = StealthyShield(
        epsilon=np.float32(0.5),
        temperature=np.float16(0.5),
        seed=np.int64(1),
        n_threads=np.int32(1),
    ).fit(VAL, LABELS)
    np.testing.assert_allclose(shield(VAL[:4]).sum(axis=1), 1.0, atol=1e-12)
