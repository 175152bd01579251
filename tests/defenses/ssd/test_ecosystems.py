"""SSD in its users' ecosystems: ART, scikit-learn and torch, with the real objects."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pandas as pd
import pytest
import scipy.sparse
import torch
from sklearn.base import clone
from sklearn.compose import ColumnTransformer
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler
from sklearn.tree import DecisionTreeClassifier
from sklearn.utils.estimator_checks import check_estimator

from defenses.ssd.defense import StealthyShield
from defenses.ssd.sklearn import ShieldedClassifier
from defenses.ssd.torch import ShieldedCallable, ShieldedModule


def _digits(n: int = 600):
    X, y = load_digits(return_X_y=True)
    return X[:n] / 16.0, y[:n]


# --- ART ---------------------------------------------------------------------------


def _art_setup():
    from art.estimators.classification import SklearnClassifier

    from defenses.ssd.art import SSDPostprocessor

    X, y = _digits()
    model = DecisionTreeClassifier(max_depth=6, random_state=0).fit(X[:300], y[:300])
    shield = StealthyShield(epsilon=2.0, seed=0, seeding="input-hash")
    shield.fit(model.predict_proba(X[300:400]), y[300:400])
    post = SSDPostprocessor(shield)
    plain = SklearnClassifier(model)
    defended = SklearnClassifier(model, postprocessing_defences=[post])
    return X, y, model, shield, plain, defended


def test_art_classifier_accepts_the_postprocessor_and_answers_through_it():
    from art.defences.postprocessor import Postprocessor

    X, _, model, shield, plain, defended = _art_setup()
    assert isinstance(defended.postprocessing_defences[0], Postprocessor)
    answers = defended.predict(X[400:])
    np.testing.assert_allclose(answers.sum(axis=1), 1.0, atol=1e-9)
    np.testing.assert_array_equal(answers, shield(model.predict_proba(X[400:])))
    assert not np.array_equal(answers, plain.predict(X[400:]))


def test_art_postprocessor_defaults_to_input_hash_seeding():
    from art.estimators.classification import SklearnClassifier

    from defenses.ssd.art import SSDPostprocessor

    X, y = _digits()
    model = DecisionTreeClassifier(max_depth=6, random_state=0).fit(X[:300], y[:300])
    shield = StealthyShield(epsilon=2.0, seed=0)  # the shield's own default: random
    shield.fit(model.predict_proba(X[300:400]), y[300:400])
    post = SSDPostprocessor(shield)
    assert post.seeding == "input-hash"
    assert post.shield.seeding == "input-hash"
    assert shield.seeding == "random"  # the given shield is not changed
    defended = SklearnClassifier(model, postprocessing_defences=[post])
    rows = X[400:]
    first = defended.predict(rows)
    np.testing.assert_array_equal(first, defended.predict(rows))
    assert np.mean(first.argmax(1) != model.predict(rows)) > 0.01
    noisy = SSDPostprocessor(shield, seeding="random")
    assert noisy.shield.seeding == "random"
    random_arm = SklearnClassifier(model, postprocessing_defences=[noisy])
    once, twice = random_arm.predict(rows), random_arm.predict(rows)
    assert np.mean(once.argmax(1) == twice.argmax(1)) < 1.0
    post.set_params(seeding="random")  # ART's own protocol
    assert post.shield.seeding == "random"
    assert shield.seeding == "random"
    with pytest.raises(ValueError, match="seeding must be one of"):
        SSDPostprocessor(shield, seeding="hash")


def test_art_membership_inference_attack_with_and_without_ssd():
    from art.attacks.inference.membership_inference import (
        MembershipInferenceBlackBoxRuleBased,
    )

    X, y, _model, _, plain, defended = _art_setup()
    members, outsiders = slice(0, 300), slice(400, 600)
    inferred = {}
    for name, classifier in (("plain", plain), ("ssd", defended)):
        attack = MembershipInferenceBlackBoxRuleBased(classifier)
        inferred[name] = np.concatenate(
            [
                attack.infer(X[members], np.eye(10)[y[members]]),
                attack.infer(X[outsiders], np.eye(10)[y[outsiders]]),
            ]
        )
    truth = np.r_[np.ones(300), np.zeros(200)]
    accuracy = {k: float(np.mean(v == truth)) for k, v in inferred.items()}
    # the rule (member iff the label is right) sees the defended labels: SSD flips
    # the arg-max of uncertain answers, and those are mostly the outsiders'
    flipped = inferred["plain"] != inferred["ssd"]
    assert flipped.any()
    assert 0.0 <= accuracy["ssd"] <= 1.0
    assert accuracy["ssd"] != accuracy["plain"]


def test_art_pytorch_classifier_with_logits_and_fit():
    from art.estimators.classification import PyTorchClassifier

    from defenses.ssd.art import SSDPostprocessor

    X, y = _digits(200)
    net = torch.nn.Sequential(torch.nn.Linear(64, 10))
    with torch.no_grad():
        logits = net(torch.from_numpy(X).float()).double()
    post = SSDPostprocessor(StealthyShield(seed=1), outputs="logits")
    post.fit(logits.numpy(), np.eye(10)[y])
    assert post.is_fitted
    classifier = PyTorchClassifier(
        net,
        loss=torch.nn.CrossEntropyLoss(),
        input_shape=(64,),
        nb_classes=10,
        postprocessing_defences=[post],
    )
    answers = classifier.predict(X.astype(np.float32))
    np.testing.assert_allclose(answers.sum(axis=1), 1.0, atol=1e-5)
    with pytest.raises(TypeError, match="shield"):
        SSDPostprocessor("not a shield")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outputs"):
        SSDPostprocessor(StealthyShield(), outputs="scores")


# --- scikit-learn ------------------------------------------------------------------


def _meta(**kwargs) -> ShieldedClassifier:
    shield = StealthyShield(seed=0, seeding="input-hash", **kwargs)
    return ShieldedClassifier(LogisticRegression(max_iter=500), shield, random_state=0)


def test_sklearn_estimator_checks_pass():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = check_estimator(_meta(), on_fail=None)
    failed = [r["check_name"] for r in results if r["status"] == "failed"]
    assert failed == []
    assert len(results) > 40


def test_sklearn_checks_that_cannot_apply_to_fresh_randomness():
    # With seeding="random" every call draws fresh pseudo-labels, so the arg-max of
    # a predict call need not match a separate predict_proba call: the only checks
    # that fail are those comparing two calls on the same rows.
    shield = StealthyShield(seed=0)
    estimator = ShieldedClassifier(
        LogisticRegression(), shield, seeding="random", random_state=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = check_estimator(estimator, on_fail=None)
    failed = {r["check_name"] for r in results if r["status"] == "failed"}
    assert failed <= {"check_classifiers_train"}


@pytest.mark.slow  # about 20 s: a second full check_estimator run
def test_sklearn_checks_with_a_fresh_key_per_fit():
    # The default shield (seed=None) draws its hash key from the operating system
    # at every fit, as a secret should be: two fits answer uncertain rows
    # differently, so check_fit_idempotent cannot hold; every other check passes.
    estimator = ShieldedClassifier(LogisticRegression(), StealthyShield())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = check_estimator(estimator, on_fail=None)
    failed = {r["check_name"] for r in results if r["status"] == "failed"}
    assert failed <= {"check_fit_idempotent"}


def _uncertain_digits():
    """A weak model on digits: its answers are uncertain, so SSD moves them."""
    X, y = _digits()
    return X, y, LogisticRegression(C=0.02, max_iter=500)


def _vote(estimator, X, repeats):
    """The voting attacker: the majority label over ``repeats`` identical queries."""
    votes = np.stack([estimator.predict(X) for _ in range(repeats)])
    return np.array([np.bincount(column).argmax() for column in votes.T])


def test_shielded_classifier_defaults_to_input_hash_seeding():
    X, y, model = _uncertain_digits()
    shield = StealthyShield(epsilon=2.0)  # StealthyShield's own default: random
    est = ShieldedClassifier(model, shield, random_state=0).fit(X[:400], y[:400])
    assert est.seeding == "input-hash"
    assert est.shield_.seeding == "input-hash"
    assert shield.seeding == "random"  # the given shield is not changed
    assert not est.__sklearn_tags__().non_deterministic
    rows = X[400:]
    first = est.predict(rows)
    assert np.array_equal(first, est.predict(rows))  # 100 % agreement
    np.testing.assert_array_equal(est.predict_proba(rows), est.predict_proba(rows))
    plain = est.estimator_.predict(rows)
    assert np.mean(first != plain) > 0.05  # the shield does move these answers
    # repeating a query and voting gains the attacker nothing
    assert np.array_equal(_vote(est, rows, 15), first)


def test_random_seeding_is_explicit_and_a_vote_averages_it_away():
    X, y, model = _uncertain_digits()
    shield = StealthyShield(epsilon=2.0, seed=0)
    est = ShieldedClassifier(model, shield, seeding="random", random_state=0)
    est.fit(X[:400], y[:400])
    assert est.shield_.seeding == "random"
    assert est.__sklearn_tags__().non_deterministic
    rows = X[400:]
    plain = est.estimator_.predict(rows)
    once = est.predict(rows)
    assert np.mean(once == est.predict(rows)) < 1.0  # two calls disagree
    single = np.mean(once == plain)
    voted = np.mean(_vote(est, rows, 15) == plain)
    assert voted > single  # the vote recovers the label SSD randomized
    resolution = StealthyShield(seeding="input-hash", hash_resolution=0.1)
    with pytest.raises(ValueError, match="hash_resolution"):
        ShieldedClassifier(model, resolution, seeding="random").fit(X, y)
    with pytest.raises(ValueError, match="seeding must be one of"):
        ShieldedClassifier(model, shield, seeding="hash").fit(X, y)


def test_clone_params_labels_of_any_type_score_and_cross_val():
    X, y = _digits()
    names = np.array(["zero", "one", "two", "three", "four", "five", "six"] + ["x"] * 3)
    labels = names[y]
    est = _meta(epsilon=1.0)
    params = est.get_params(deep=True)
    assert params["estimator__C"] == 1.0
    assert params["shield__epsilon"] == 1.0
    copy = clone(est).set_params(estimator__C=0.5, shield__epsilon=0.25)
    assert copy.estimator.C == 0.5
    assert copy.shield.epsilon == 0.25
    assert est.shield.epsilon == 1.0
    copy.fit(X, labels)
    assert set(copy.predict(X)) <= set(labels)
    assert 0.8 < copy.score(X, labels) <= 1.0
    scores = cross_val_score(_meta(), X, labels, cv=3)
    assert scores.shape == (3,)
    assert scores.min() > 0.7
    with pytest.raises(ValueError, match="y contains NaN"):
        _meta().fit(X[:4], np.array([1.0, np.nan, 2.0, 1.0]))


def test_pipeline_on_a_dataframe_with_a_string_column_and_grid_search():
    rng = np.random.default_rng(0)
    n = 300
    colour = rng.choice(["red", "green", "blue"], n)
    size = rng.normal(size=n)
    y = np.where(colour == "red", "warm", "cold")
    y[size > 1.2] = "big"
    frame = pd.DataFrame({"colour": colour, "size": size})
    pipe = Pipeline(
        [
            (
                "prep",
                ColumnTransformer(
                    [
                        ("cat", OneHotEncoder(), ["colour"]),
                        ("num", StandardScaler(), ["size"]),
                    ]
                ),
            ),
            ("ssd", _meta()),
        ]
    )
    pipe.fit(frame, y)
    assert set(pipe.predict(frame)) <= {"warm", "cold", "big"}
    again = pipe.predict_proba(frame)
    np.testing.assert_array_equal(again, pipe.predict_proba(frame))
    grid = GridSearchCV(
        pipe,
        {"ssd__shield__epsilon": [0.1, 1.0], "ssd__estimator__C": [0.1, 1.0]},
        cv=3,
    )
    grid.fit(frame, y)
    assert set(grid.best_params_) == {"ssd__shield__epsilon", "ssd__estimator__C"}


def test_sparse_features_and_prefit():
    X, y = _digits()
    sparse = scipy.sparse.csr_matrix(X)
    est = _meta().fit(sparse, y)
    np.testing.assert_allclose(est.predict_proba(sparse).sum(axis=1), 1.0, atol=1e-9)
    fitted = LogisticRegression(max_iter=500).fit(X[:400], y[:400])
    pre = ShieldedClassifier(fitted, StealthyShield(seed=0), prefit=True)
    pre.fit(X[400:], y[400:])
    assert pre.estimator_ is fitted
    wrapped = StealthyShield(seed=0).fit(fitted.predict_proba(X[400:]), y[400:])
    protected = wrapped.wrap(fitted)
    assert set(protected.predict(X)) <= set(range(10))
    assert protected.shield_.seeding == "input-hash"
    assert wrapped.seeding == "random"
    np.testing.assert_array_equal(
        protected.predict_proba(X), protected.predict_proba(X)
    )


# --- torch -------------------------------------------------------------------------


def _fitted_shield(k: int, seeding: str = "random", seed: int = 3) -> StealthyShield:
    rng = np.random.default_rng(0)
    val = rng.dirichlet(np.full(k, 0.3), 20 * k)
    return StealthyShield(epsilon=1.5, seed=seed, seeding=seeding).fit(
        val, np.arange(20 * k) % k
    )


@pytest.mark.parametrize("seeding", ["random", "input-hash"])
def test_shielded_module_survives_save_and_load(seeding):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 5)
    )
    module = ShieldedModule(net, _fitted_shield(5, seeding), seeding=seeding)
    x = torch.randn(40, 6)
    module(x)  # moves the random stream: the saved state must carry it
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert {"shield_prototypes", "shield_settings", "shield_stream"} <= set(state)
    fresh_net = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 5)
    )
    restored = ShieldedModule(fresh_net, StealthyShield())
    restored.load_state_dict(state)
    assert restored.shield.epsilon == 1.5
    assert restored.shield.seeding == seeding
    np.testing.assert_array_equal(restored(x).numpy(), module(x).numpy())


@pytest.mark.parametrize(
    ("last", "to_probs"),
    [
        (torch.nn.Softmax(dim=1), lambda z: torch.softmax(z, 1)),
        (torch.nn.LogSoftmax(dim=1), lambda z: torch.softmax(z, 1)),
    ],
)
def test_softmax_endings_are_never_softmaxed_twice(last, to_probs):
    torch.manual_seed(1)
    linear = torch.nn.Linear(4, 3).double()
    x = torch.randn(200, 4, dtype=torch.float64)
    shield_a = _fitted_shield(3, seed=7)
    shield_b = _fitted_shield(3, seeding="input-hash", seed=7)
    wrapped = shield_a.wrap(torch.nn.Sequential(linear, last))  # input-hash default
    with torch.no_grad():
        expected = shield_b(to_probs(linear(x)), inputs=x)
    np.testing.assert_allclose(wrapped(x).numpy(), expected.numpy(), atol=1e-12)


def test_probability_outputs_refused_as_logits_and_detected_when_auto():
    class Functional(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x, dim=1)

    x = torch.randn(50, 3, dtype=torch.float64)
    shield = _fitted_shield(3, seeding="input-hash")
    with pytest.raises(ValueError, match="outputs='probs'"):
        ShieldedModule(Functional(), shield, outputs="logits")(x)
    auto = ShieldedModule(Functional(), shield)(x)
    direct = ShieldedModule(Functional(), shield, outputs="probs")(x)
    np.testing.assert_array_equal(auto.numpy(), direct.numpy())
    call = ShieldedCallable(lambda z: torch.softmax(z, dim=1), shield)
    np.testing.assert_array_equal(call(x).numpy(), direct.numpy())
    with pytest.raises(ValueError, match="outputs must be one of"):
        ShieldedModule(Functional(), shield, outputs="scores")


# --- input-hash seeding --------------------------------------------------------------


def test_input_hash_accepts_frames_and_sparse_and_refuses_row_mismatch():
    shield = _fitted_shield(3, seeding="input-hash")
    probs = np.tile([[0.36, 0.33, 0.31]], (8, 1))
    frame = pd.DataFrame({"a": np.arange(8.0), "b": list("abcdefgh")})
    first = shield(probs, inputs=frame)
    np.testing.assert_array_equal(first, shield(probs, inputs=frame.copy()))
    assert len({tuple(r) for r in first.round(9)}) > 1
    sparse = scipy.sparse.random(8, 5, density=0.5, random_state=0, format="coo")
    np.testing.assert_array_equal(
        shield(probs, inputs=sparse), shield(probs, inputs=sparse.tocsr())
    )
    with pytest.raises(ValueError, match="inputs must have one row per row of probs"):
        shield(probs, inputs=np.zeros((16, 2)))
    with pytest.raises(ValueError, match="inputs"):
        shield(probs, inputs=frame.iloc[:4])


def test_hash_resolution_keeps_nan_inf_and_huge_apart():
    shield = StealthyShield(seed=0, seeding="input-hash", hash_resolution=0.5)
    shield.fit(np.eye(3) * 0.9 + 0.1 / 3, np.arange(3))
    from defenses.ssd.seeding import input_keys

    inputs = np.array([[np.nan], [np.inf], [-np.inf], [1e300], [2e300], [0.1], [0.2]])
    keys = input_keys(inputs, 7, 0.5)
    assert len(set(keys[:5])) == 5
    assert keys[5] == keys[6]  # both round to grid point 0
    assert input_keys(np.array([[-0.0]]), 1, None) == input_keys(
        np.array([[0.0]]), 1, None
    )


def test_wrap_accepts_a_model_that_is_no_sklearn_estimator():
    class Plain:
        def predict_proba(self, X):
            return np.tile([[0.6, 0.3, 0.1]], (len(X), 1))

    shield = StealthyShield(seed=0).fit(np.eye(3) * 0.7 + 0.1, np.arange(3))
    protected = shield.wrap(Plain())
    assert protected.predict_proba(np.zeros((5, 2))).shape == (5, 3)
    assert set(protected.predict(np.zeros((5, 2)))) <= {0, 1, 2}
