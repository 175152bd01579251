"""Soundness: no certified (point, class) membership changes within its radius."""

import itertools

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from defenses.data import load_digits, stratified_split
from defenses.harness import run_once
from defenses.rps import ReliableConformalClassifier
from defenses.rps.arms import RPS
from defenses.rps.ensemble import ConstantClassifier
from defenses.rps.partition import partition
from defenses.rps.parts import FittedParts
from defenses.rps.scenario import ConformalPoisoning
from tests.defenses.rps.attack_set import attack_set

K_T, K_C, ALPHA = 5, 3, 0.2


@pytest.fixture(scope="module")
def small():
    data = load_digits()
    keep = data.y < 4
    X, y = data.X[keep], data.y[keep]
    tr, ca, te = stratified_split(y, [0.3, 0.3, 0.4], np.random.default_rng(3))
    model = ReliableConformalClassifier(
        LogisticRegression(max_iter=500),
        n_train_parts=K_T,
        n_calib_parts=K_C,
        confidence_level=1 - ALPHA,
    )
    model.fit(X[tr], y[tr]).conformalize(X[ca], y[ca])
    return model, (X[tr], y[tr]), (X[ca], y[ca]), X[te]


def _use(model, models):
    """Swap the fitted part models (the brute-force worst case of ``r_t`` votes)."""
    model.estimators_ = models
    model._parts = FittedParts(models, None, model.n_classes)


def _assert_sound(cert, outcomes):
    """No certified membership changes in any ``(sets, r_t, r_c)`` outcome (sets
    after a poisoning within those radii), and some sets do change."""
    changed = 0
    for after, r_t, r_c in outcomes:
        moved = cert.sets != after
        assert not np.any(cert.certified(r_t, r_c) & moved), (r_t, r_c)
        changed += int(np.sum(moved))
    assert changed > 0


def _sets(model, X):
    return model.predict_set(X)[1][:, :, 0]


def _constant_parts(model, Xc, yc, Xs):
    """Replace one or two part models by constants of every class (brute force)."""
    original = list(model.estimators_)
    try:
        for r_t in (1, 2):
            for parts in itertools.combinations(range(K_T), r_t):
                for labels in itertools.product(range(4), repeat=r_t):
                    models = list(original)
                    for part, label in zip(parts, labels, strict=True):
                        models[part] = ConstantClassifier(label)
                    _use(model, models)
                    model.conformalize(Xc, yc)
                    yield _sets(model, Xs), r_t, 0
    finally:
        _use(model, original)
        model.conformalize(Xc, yc)


def _label_flips(Xt, yt, Xc, yc, Xs):
    """Relabel half of one or two training parts at random and retrain."""
    parts = partition(Xt, yt, K_T)
    rng = np.random.default_rng(0)
    for trial in range(6):
        r_t = 1 + trial % 2
        y = yt.copy()
        for part in rng.choice(K_T, size=r_t, replace=False):
            rows = parts[part]
            flip = rng.choice(rows, size=max(1, rows.size // 2), replace=False)
            y[flip] = rng.integers(0, 4, flip.size)
        poisoned = ReliableConformalClassifier(
            LogisticRegression(max_iter=500),
            n_train_parts=K_T,
            n_calib_parts=K_C,
            confidence_level=1 - ALPHA,
        )
        poisoned.fit(Xt, y).conformalize(Xc, yc)
        yield _sets(poisoned, Xs), r_t, 0


def _rewritten_calibration_parts(model, Xc, yc, Xs):
    """Rewrite whole calibration parts: relabel or drop their points."""
    parts = partition(Xc, yc, K_C)
    rng = np.random.default_rng(1)
    try:
        for part in range(K_C):
            rows = parts[part]
            y = yc.copy()
            y[rows] = rng.integers(0, 4, rows.size)
            dropped = rows[: rows.size // 3]
            for X2, y2 in (
                (Xc, y),
                (np.delete(Xc, dropped, 0), np.delete(yc, dropped)),
            ):
                model.conformalize(X2, y2)
                yield _sets(model, Xs), 0, 1
    finally:
        model.conformalize(Xc, yc)


def test_vote_level_worst_case(small):
    model, _, (Xc, yc), Xs = small
    _assert_sound(model.certify(Xs), _constant_parts(model, Xc, yc, Xs))


def test_training_label_flips_within_radius(small):
    model, (Xt, yt), (Xc, yc), Xs = small
    _assert_sound(model.certify(Xs), _label_flips(Xt, yt, Xc, yc, Xs))


def test_calibration_poisoning_within_radius(small):
    model, _, (Xc, yc), Xs = small
    cert = model.certify(Xs)
    _assert_sound(cert, _rewritten_calibration_parts(model, Xc, yc, Xs))
    assert cert.certified(0, 1).mean() > 0.5


def _scenario():
    return ConformalPoisoning(
        dataset="digits", subsample=0.5, n_targets=1, confidence_level=1 - ALPHA
    )


@pytest.mark.parametrize(
    "attack",
    attack_set(3, (0.01, 0.01, 0.01), (3, 8, 0.05), (8, 3)),
    ids=lambda a: a.name,
)
def test_every_attack_respects_the_certificate(attack):
    result = run_once(
        _scenario(), attack, RPS(n_train_parts=8, n_calib_parts=3), seed=0
    )
    assert result.success["violations"] == 0.0
    assert result.success["radius_train"] + result.success["radius_calib"] >= 1
