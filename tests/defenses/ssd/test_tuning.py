"""choose_epsilon: the chosen epsilon meets its accuracy budget on data it never saw."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.ensemble import RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split

from defenses.ssd import StealthyShield
from defenses.ssd.tuning import (
    EpsilonSearch,
    choose_epsilon,
    harm_bound,
    rows_needed,
)


def _split():
    X, y = load_digits(return_X_y=True)
    rows = np.arange(y.size)
    train, rest = train_test_split(rows, test_size=0.5, stratify=y, random_state=0)
    val, test = train_test_split(rest, test_size=0.5, stratify=y[rest], random_state=0)
    return X, y, train, val, test


def _drop(model, shield, X, y):
    probs = model.predict_proba(X)
    plain = np.mean(probs.argmax(axis=1) == y)
    return plain - np.mean(shield(probs, inputs=X).argmax(axis=1) == y)


def test_the_chosen_epsilon_meets_the_target_on_held_out_data():
    X, y, train, val, test = _split()
    forest = RandomForestClassifier(n_estimators=100, random_state=0, n_jobs=1)
    forest.fit(X[train], y[train])
    target = 0.03
    choice = choose_epsilon(
        forest.predict_proba(X[val]),
        y[val],
        EpsilonSearch(max_accuracy_drop=target),
        shield=StealthyShield(seed=0, seeding="input-hash"),
        inputs=X[val],
    )
    assert choice.shield.epsilon == choice.epsilon
    assert choice.shield.seeding == "input-hash"
    assert all(b <= target for b in choice.bounds[:-1])
    assert _drop(forest, choice.shield, X[test], y[test]) <= target
    # the library default (0.5) would cost this forest far more than the target
    default = StealthyShield(epsilon=0.5, seed=0, seeding="input-hash")
    default.fit(forest.predict_proba(X[val]), y[val])
    assert _drop(forest, default, X[test], y[test]) > 3 * target
    assert choice.epsilon < 0.5


def test_a_confident_model_gets_a_large_epsilon_within_budget():
    X, y, train, val, test = _split()
    model = LogisticRegression(max_iter=2000).fit(X[train], y[train])
    choice = choose_epsilon(
        model.predict_proba(X[val]),
        y[val],
        EpsilonSearch(max_accuracy_drop=0.03),
        inputs=X[val],
    )
    assert choice.epsilon >= 0.5
    assert _drop(model, choice.shield, X[test], y[test]) <= 0.03


def test_the_bound_holds_with_the_stated_confidence():
    # Monte Carlo over fresh validation samples: the share of searches whose
    # chosen epsilon costs more than the target on the distribution (measured on
    # 20,000 fresh rows) must stay within delta (plus sampling slack).
    rng = np.random.default_rng(0)
    k, target, delta = 4, 0.05, 0.1

    def draw(n):
        labels = rng.integers(0, k, n)
        logits = rng.normal(size=(n, k)) * 0.8
        logits[np.arange(n), labels] += rng.uniform(0.0, 3.0, n)
        probs = np.exp(logits)
        return probs / probs.sum(axis=1, keepdims=True), labels

    fresh_probs, fresh_labels = draw(20_000)
    right = fresh_probs.argmax(axis=1) == fresh_labels
    search = EpsilonSearch(max_accuracy_drop=target, confidence=1 - delta)
    violations = 0
    trials = 60
    for trial in range(trials):
        probs, labels = draw(300)
        shield = StealthyShield(seed=trial, seeding="random")
        choice = choose_epsilon(probs, labels, search, shield=shield)
        answers = choice.shield(fresh_probs).argmax(axis=1) == fresh_labels
        violations += np.mean(right & ~answers) > target
    assert violations / trials <= delta + 0.05  # the point estimate gives 0.23


def test_too_few_rows_is_refused_with_the_rows_needed():
    X, y, train, val, _ = _split()
    model = LogisticRegression(max_iter=2000).fit(X[train], y[train])
    need = rows_needed(0.005, 0.95)
    assert harm_bound(0, need, 0.95) <= 0.005 < harm_bound(0, need - 1, 0.95)
    with pytest.raises(ValueError, match=f"at least {need} check rows"):
        choose_epsilon(
            model.predict_proba(X[val[:100]]),
            y[val[:100]],
            EpsilonSearch(max_accuracy_drop=0.005),
        )


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("max_accuracy_drop", 0.0, "max_accuracy_drop"),
        ("max_accuracy_drop", 1.5, "max_accuracy_drop"),
        ("confidence", 1.0, "confidence"),
        ("check_size", 0.0, "check_size"),
        ("candidates", (), "at least one"),
        ("candidates", (0.5, 0.1), "strictly increasing"),
        ("candidates", (0.1, -1.0), r"candidates\[1\]"),
        ("candidates", (0.1, float("nan")), r"candidates\[1\]"),
        ("random_state", -1, "random_state"),
    ],
)
def test_search_settings_are_checked(field, value, match):
    with pytest.raises(ValueError, match=match):
        EpsilonSearch(**{field: value})


def test_bad_input_is_refused():
    probs = np.full((10, 3), 1 / 3)
    with pytest.raises(ValueError, match="val_labels"):
        choose_epsilon(probs, np.zeros(9, dtype=int))
    with pytest.raises(ValueError, match="val_probs"):
        choose_epsilon(probs * 2, np.arange(10) % 3)
    with pytest.raises(TypeError, match="StealthyShield"):
        choose_epsilon(probs, np.arange(10) % 3, shield="shield")  # type: ignore[arg-type]


def test_protect_within_budget_with_string_labels_frames_and_sparse():
    import pandas as pd
    import scipy.sparse

    from defenses.ssd.tuning import protect_within_budget

    X, y, train, val, test = _split()
    words = np.array([f"digit {d}" for d in range(10)])
    frame = pd.DataFrame(X, columns=[f"p{i}" for i in range(64)])
    forest = RandomForestClassifier(n_estimators=100, random_state=0, n_jobs=1)
    forest.fit(frame.iloc[train], words[y[train]])
    target = 0.03
    protected, choice = protect_within_budget(
        forest,
        frame.iloc[val],
        words[y[val]],
        EpsilonSearch(max_accuracy_drop=target),
        shield=StealthyShield(seed=0),
    )
    assert protected.seeding == "input-hash"
    assert protected.shield_.epsilon == choice.epsilon
    rows = frame.iloc[test]
    answers = protected.predict(rows)
    assert set(answers) <= set(words)
    assert np.array_equal(answers, protected.predict(rows))  # same input, same answer
    plain = np.mean(forest.predict(rows) == words[y[test]])
    assert plain - np.mean(answers == words[y[test]]) <= target
    sparse_model = LogisticRegression(max_iter=2000).fit(
        scipy.sparse.csr_matrix(X[train]), y[train]
    )
    _, sparse_choice = protect_within_budget(
        sparse_model,
        scipy.sparse.coo_matrix(X[val]),
        y[val],
        EpsilonSearch(max_accuracy_drop=0.03),
    )
    assert sparse_choice.epsilon > 0
    with pytest.raises(ValueError, match="labels the estimator does not know"):
        protect_within_budget(forest, frame.iloc[val], y[val])
    with pytest.raises(TypeError, match="predict_proba and classes_"):
        protect_within_budget(object(), X[val], y[val])
