"""A restored RPS state is checked against itself and its parts (issue 40 item 5).

The serving layer's digests catch files changed without rewriting the digests; these
tests edit the state *after* the digests (as whoever may rewrite every file can) and
call :func:`defenses.rps.mlflow.restore` directly: every edit that leaves a state
which is not one classifier's for these parts is refused, naming the attribute.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
from sklearn.datasets import make_classification
from sklearn.linear_model import LogisticRegression

mlflow = pytest.importorskip("mlflow")

from defenses.rps import ReliableConformalClassifier  # noqa: E402
from defenses.rps import mlflow as rps_mlflow  # noqa: E402
from defenses.rps.state import check_restored  # noqa: E402
from defenses.serving import read_shielded  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    X, y = make_classification(
        600, 5, n_informative=4, n_redundant=0, n_classes=3, random_state=1
    )
    rps = ReliableConformalClassifier(
        LogisticRegression(max_iter=300), n_train_parts=5, n_calib_parts=3
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rps.fit(X[:400], y[:400]).conformalize(X[400:550], y[400:550])
    folder = tmp_path_factory.mktemp("rps") / "m"
    rps_mlflow.save_model(rps, folder)
    state, config = read_shielded(folder / "data" / "shield")
    return rps, state, config, X[550:]


def edited(saved):
    rps, state, config, _ = saved
    return rps, dict(state), copy.deepcopy(config), list(rps.estimators_)


def test_the_saved_state_restores_to_the_same_sets(saved):
    rps, state, config, X = saved
    restored = rps_mlflow.restore(dict(state), copy.deepcopy(config), rps.estimators_)
    assert np.array_equal(restored.predict_set(X)[1], rps.predict_set(X)[1])
    check_restored(rps, rps.estimators_)


def _thresholds_reshaped(state, config, parts):
    name = config["fitted"]["thresholds_"]["array"]
    state[name] = np.append(state[name], 0.5)


def _bounds_reversed(state, config, parts):
    name = config["fitted"]["part_thresholds_"]["fields"]["upper"]["array"]
    state[name] = state[name][::-1].copy()


def _tau_hat_zero(state, config, parts):
    config["fitted"]["tau_hat_"] = 0
    for level in config["fitted"]["level_thresholds_"]["tuple"]:
        level["fields"]["tau_hat"] = 0
    config["fitted"]["part_thresholds_"]["fields"]["tau_hat"] = 0


def _another_level(state, config, parts):
    config["params"]["confidence_level"] = 0.8


def _part_missing(state, config, parts):
    parts.pop()


def _part_of_another_task(state, config, parts):
    X, y = make_classification(100, 5, n_informative=4, n_redundant=0, n_classes=5)
    parts[2] = LogisticRegression(max_iter=200).fit(X, y)


def _guard_out_of_step(state, config, parts):
    config["fitted"]["guard_"] = 999


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_thresholds_reshaped, r"thresholds_"),
        (_bounds_reversed, r"not sorted|narrow|differ"),
        (_tau_hat_zero, r"tau_hat"),
        (_another_level, r"ranks_|guard|tau_hat"),
        (_part_missing, r"parts number 4, expected n_train_parts=5"),
        (_part_of_another_task, r"part 2 predicts labels"),
        (_guard_out_of_step, r"guard_ is \[999\]"),
    ],
    ids=lambda value: value.__name__.strip("_") if callable(value) else "refused",
)
def test_an_edited_state_is_refused_naming_the_attribute(saved, edit, match):
    """Edits made after the digests: each leaves a state that is not one
    classifier's for these parts, and restore refuses it, naming the attribute."""
    _, state, config, parts = edited(saved)
    edit(state, config, parts)
    with pytest.raises(ValueError, match=match):
        rps_mlflow.restore(state, config, parts)
