"""The bad-input rule on the audit's public entry points."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sklearn.linear_model import LogisticRegression

from defenses.audit import AuditConfig, ShadowConfig, audit, threat_model
from defenses.testing import (
    assert_rule,
    bad_arrays,
    bad_reals,
    probability_rows,
    rule_settings,
)

FAST = AuditConfig(seeds=(0,), progress=False)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(40, 5))
Y = (X[:, 0] > 0).astype(np.int64)
MODEL = LogisticRegression().fit(X[:20], Y[:20])


def _valid_report(report):
    for result in report.results:
        assert 0.0 <= result.success["auc"] <= 1.0
        assert 0.0 <= result.utility["accuracy"] <= 1.0


@rule_settings(max_examples=10)
@given(bad_arrays((20, 5)))
def test_bad_member_features(features):
    assert_rule(
        lambda: audit(MODEL, (features, Y[:20]), (X[20:], Y[20:]), config=FAST),
        ["members", "model"],
        _valid_report,
    )


@rule_settings(max_examples=10)
@given(bad_arrays((20,)))
def test_bad_non_member_labels(labels):
    assert_rule(
        lambda: audit(MODEL, (X[:20], Y[:20]), (X[20:], labels), config=FAST),
        ["non_members"],
        _valid_report,
    )


@rule_settings(max_examples=10)
@given(probability_rows(40, 2))
def test_a_model_answering_bad_probabilities(rows):
    answers = np.asarray(rows)

    def model(x):
        return answers[: len(x)] if len(x) <= len(answers) else answers

    assert_rule(
        lambda: audit(model, (X[:20], Y[:20]), (X[20:], Y[20:]), config=FAST),
        ["model"],
        _valid_report,
    )


@rule_settings(max_examples=20)
@given(bad_reals())
def test_bad_numbers(value):
    assert_rule(lambda: threat_model(queries=value), ["queries"])
    assert_rule(lambda: AuditConfig(delta=value), ["AuditConfig.delta"])
    assert_rule(lambda: AuditConfig(confidence=value), ["AuditConfig.confidence"])
    assert_rule(lambda: AuditConfig(per_target=value), ["AuditConfig.per_target"])
    assert_rule(lambda: ShadowConfig(lr=value), ["ShadowConfig.lr"])
    assert_rule(lambda: ShadowConfig(n_shadows=value), ["ShadowConfig.n_shadows"])


@rule_settings(max_examples=10)
@given(st.one_of(bad_reals(), st.sampled_from([(0, 1), [0, 1], (1.0, 0.0), "box"])))
def test_bad_bounds(bounds):
    assert_rule(
        lambda: audit(
            MODEL,
            (X[:20], Y[:20]),
            (X[20:], Y[20:]),
            bounds=bounds,
            config=FAST,
        ),
        ["bounds"],
        _valid_report,
    )


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"private_class": 7}, "private_class"),
        ({"threat": "scores"}, "threat"),
        ({"config": {"seeds": [0]}}, "config"),
        ({"build_model": 3}, "build_model"),
        ({"input_shape": (2, 2)}, "input_shape"),
        ({"outputs": "logits"}, "outputs"),
        ({"name": ""}, "name"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        audit(MODEL, (X[:20], Y[:20]), (X[20:], Y[20:]), **kwargs)
