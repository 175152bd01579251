"""StealthyShield: fitting, sampling, seeding, wrapping, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.linear_model import LogisticRegression

from defenses.ssd.defense import StealthyShield, default_temperature, entropy
from defenses.ssd.sklearn import ShieldedClassifier
from defenses.ssd.torch import ShieldedCallable, ShieldedModule

VAL = np.array([[0.9, 0.05, 0.05], [0.1, 0.8, 0.1], [0.05, 0.15, 0.8], [0.8, 0.1, 0.1]])
LABELS = np.array([0, 1, 2, 0])


def _shield(**kwargs) -> StealthyShield:
    return StealthyShield(**kwargs).fit(VAL, LABELS)


def test_prototypes_are_class_means():
    shield = _shield(seed=0)
    np.testing.assert_allclose(shield.prototypes_[0], [0.85, 0.075, 0.075], atol=1e-10)
    np.testing.assert_allclose(shield.prototypes_[1], VAL[1], atol=1e-10)
    assert shield.n_classes == 3


def test_temperature_rule_matches_notes():
    assert default_temperature(1000) == pytest.approx(0.1, abs=0.003)
    assert default_temperature(10) == pytest.approx(0.20, abs=0.01)
    assert default_temperature(50) == pytest.approx(0.15, abs=0.01)
    assert default_temperature(5) == pytest.approx(0.9 / math.log(36))
    assert default_temperature(2) == 1.0


def test_entropy_handles_zeros_and_matches_golden():
    assert entropy(np.array([[0.7, 0.2, 0.1]]))[0] == pytest.approx(0.8018, abs=1e-4)
    assert entropy(np.array([[1.0, 0.0]]))[0] == 0.0
    assert float(entropy(torch.tensor([[0.5, 0.5]]))[0]) == pytest.approx(math.log(2))


def test_same_seed_same_answers_and_output_on_simplex():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), 200)
    a, b = _shield(seed=3)(probs), _shield(seed=3)(probs)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a.sum(axis=1), 1.0, atol=1e-12)
    assert np.all(np.abs(a - probs).sum(axis=1) <= 0.5 * entropy(probs) + 1e-12)


def test_confident_outputs_barely_move_uncertain_ones_flip():
    shield = _shield(seed=0, epsilon=1.0)
    confident = np.tile([[0.998, 0.001, 0.001]], (500, 1))
    uncertain = np.tile([[0.36, 0.33, 0.31]], (500, 1))
    moved = np.abs(shield(confident) - confident).sum(axis=1)
    assert moved.max() < 0.05
    flips = np.argmax(shield(uncertain), axis=1) != 0
    assert flips.mean() > 0.3


def test_input_hash_seeding_repeats_answers():
    shield = _shield(seed=1, seeding="input-hash", epsilon=2.0)
    probs = np.tile([[0.36, 0.33, 0.31]], (64, 1))
    inputs = np.arange(64.0)[:, None]
    first, again = shield(probs, inputs=inputs), shield(probs, inputs=inputs)
    np.testing.assert_array_equal(first, again)
    assert len({tuple(np.round(r, 9)) for r in first}) > 1


def test_hash_resolution_shares_answers_of_nearby_inputs():
    shield = _shield(seed=1, seeding="input-hash", epsilon=2.0, hash_resolution=0.1)
    probs = np.tile([[0.36, 0.33, 0.31]], (50, 1))
    base = np.full((50, 4), 0.52)
    jitter = base + np.random.default_rng(0).uniform(-0.01, 0.01, base.shape)
    np.testing.assert_array_equal(
        shield(probs, inputs=base), shield(probs, inputs=jitter)
    )


def test_random_seeding_votes_recover_label_but_hash_seeding_does_not():
    probs = np.tile([[0.4, 0.33, 0.27]], (301, 1))
    fresh = _shield(seed=2, epsilon=2.0, temperature=0.5)
    votes = np.bincount(fresh.predict_label(probs), minlength=3)
    assert np.argmax(votes) == 0
    hashed = _shield(seed=2, epsilon=2.0, temperature=0.5, seeding="input-hash")
    one_query = np.zeros((301, 2))
    labels = hashed.predict_label(probs, inputs=one_query)
    assert len(set(labels.tolist())) == 1
    assert any(
        _shield(
            seed=s, epsilon=2.0, temperature=0.5, seeding="input-hash"
        ).predict_label(probs[:1], inputs=one_query[:1])[0]
        != 0
        for s in range(20)
    )


def test_torch_path_matches_numpy_path():
    rng = np.random.default_rng(4)
    probs = rng.dirichlet(np.ones(3), 50)
    a = _shield(seed=5)(probs)
    b = _shield(seed=5)(torch.from_numpy(probs))
    assert isinstance(b, torch.Tensor)
    np.testing.assert_allclose(a, b.numpy(), atol=1e-12)


def test_wrap_torch_module_sklearn_and_callable():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 4))
    y = np.arange(60) % 3
    shield = _shield(seed=0)
    module = torch.nn.Linear(4, 3).double()
    wrapped = shield.wrap(module)
    assert isinstance(wrapped, ShieldedModule)
    out = wrapped(torch.from_numpy(X))
    np.testing.assert_allclose(out.sum(1).numpy(), 1.0, atol=1e-12)
    clf = LogisticRegression().fit(X, y)
    protected = shield.wrap(clf)
    assert isinstance(protected, ShieldedClassifier)
    assert protected.predict_proba(X).shape == (60, 3)
    assert set(protected.predict(X)) <= {0, 1, 2}
    fn = shield.wrap(clf.predict_proba)
    assert isinstance(fn, ShieldedCallable)
    np.testing.assert_allclose(fn(X).sum(axis=1), 1.0, atol=1e-12)
    logit_fn = shield.wrap(clf.decision_function, outputs="logits")
    np.testing.assert_allclose(logit_fn(X).sum(axis=1), 1.0, atol=1e-12)


def test_wrap_leaves_model_unchanged():
    module = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in module.parameters()]
    _shield(seed=0).wrap(module)(torch.zeros(2, 4))
    assert all(
        torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True)
    )


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 40), st.floats(0.05, 3.0), st.integers(0, 2**31))
def test_shield_never_returns_nan(k, epsilon, seed):
    rng = np.random.default_rng(seed)
    val = rng.dirichlet(np.full(k, 0.1), 4 * k)
    shield = StealthyShield(epsilon=epsilon, seed=seed).fit(val, np.arange(4 * k) % k)
    probs = rng.dirichlet(np.full(k, 0.05), 30)
    probs[0] = np.eye(k)[0]
    out = shield(probs)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out.sum(axis=1), 1.0, atol=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": 0.0}, r"epsilon must be a finite number > 0\.0"),
        ({"epsilon": float("nan")}, "epsilon"),
        ({"temperature": -1.0}, "temperature"),
        ({"seeding": "lsh"}, "seeding must be one of"),
        ({"hash_resolution": 0.1}, "needs seeding='input-hash'"),
        ({"seeding": "input-hash", "hash_resolution": 0.0}, "hash_resolution"),
        ({"seed": 1.5}, "seed must be an int"),
    ],
)
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StealthyShield(**kwargs)


def test_unfitted_and_bad_fit_inputs():
    with pytest.raises(RuntimeError, match="not fitted"):
        StealthyShield()(np.ones((1, 3)) / 3)
    with pytest.raises(ValueError, match="no validation sample"):
        StealthyShield().fit(VAL, np.array([0, 0, 0, 1]))
    with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
        StealthyShield().fit(VAL, np.array([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="integers of shape"):
        StealthyShield().fit(VAL, np.array([0.0, 1.0, 2.0, 0.0]))
    with pytest.raises(ValueError, match="sum to 1"):
        StealthyShield().fit(VAL * 2, LABELS)


def test_bad_probabilities_at_call():
    shield = _shield(seed=0)
    with pytest.raises(ValueError, match=r"shape \(N, 3\)"):
        shield(np.ones((2, 4)) / 4)
    with pytest.raises(ValueError, match="sum to 1"):
        shield(np.array([[0.5, 0.5, 0.5]]))
    with pytest.raises(ValueError, match="negative"):
        shield(np.array([[1.2, -0.1, -0.1]]))
    with pytest.raises(ValueError, match="outputs must be"):
        shield.wrap(lambda x: x, outputs="scores")
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.Module"):
        shield.wrap(42)


def test_entropy_terms_are_scipys_entr():
    from scipy.special import entr

    rows = np.array([[0.0, 0.25, 0.75], [-1.0, 0.5, 0.5], [np.nan, 0.5, 0.5]])
    rows = np.vstack([rows, [[np.inf, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    expected = entr(rows).sum(axis=1)
    np.testing.assert_array_equal(entropy(rows), expected)
