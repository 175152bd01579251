"""The bad-input rule on the shared modules: metrics, data, results, oracle.

Every call either returns a valid result or raises ValueError/TypeError naming the
parameter (``defenses.testing.assert_rule``), for generated bad and edge inputs.
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from defenses import data, metrics
from defenses.oracle import QueryBudgetExceeded, QueryOracle
from defenses.testing import assert_rule, bad_arrays, bad_reals, rule_settings

SCORES = ["scores", "truth"]

# right-shaped scores with NaN, inf and huge entries, beside the shared strategy's
SCORE_ROWS = hnp.arrays(np.float64, 12, elements=st.floats(allow_nan=True))

# membership bits with both classes, so that bad scores reach the computation
TRUTH = st.lists(st.booleans(), min_size=10, max_size=10).map(
    lambda bits: np.array([True, False, *bits])
)


def _rate(value):
    assert 0.0 <= value <= 1.0


@rule_settings(25)
@given(st.one_of(SCORE_ROWS, bad_arrays((12,))), st.one_of(TRUTH, bad_arrays((12,))))
def test_membership_metrics(scores, truth):
    for function in (metrics.auc, metrics.advantage):
        assert_rule(lambda f=function: f(scores, truth), SCORES, _rate)

    def valid(result):
        assert set(result) == {"auc", "advantage", "tpr@1%fpr", "tpr@0.1%fpr"}
        for value in result.values():
            _rate(value)

    assert_rule(lambda: metrics.membership_metrics(scores, truth), SCORES, valid)

    def curve(result):
        fpr, tpr = result
        assert fpr.shape == tpr.shape
        assert fpr[0] == tpr[0] == 0.0
        assert fpr[-1] == tpr[-1] == 1.0
        assert np.all(np.diff(fpr) >= 0)
        assert np.all(np.diff(tpr) >= 0)

    assert_rule(lambda: metrics.roc(scores, truth), SCORES, curve)


@rule_settings(25)
@given(bad_reals())
def test_tpr_at_fpr_threshold(fpr):
    scores = np.linspace(0, 1, 10)
    truth = np.arange(10) % 2 == 0
    assert_rule(lambda: metrics.tpr_at_fpr(scores, truth, fpr), ["fpr"], _rate)


@rule_settings(25)
@given(bad_reals(), bad_reals(), bad_reals())
def test_epsilon_lower_bound(tpr, fpr, delta):
    def bounded():  # an infinite bound is valid here (FPR 0 and TPR > delta)
        return min(metrics.epsilon_lower_bound(tpr, fpr, delta), 1e300)

    def valid(value):
        assert value >= 0.0

    assert_rule(bounded, ["tpr", "fpr", "delta"], valid)


@rule_settings(25)
@given(
    st.one_of(bad_reals(), st.integers(-3, 30)),
    st.one_of(bad_reals(), st.integers(-3, 30)),
    bad_reals(),
)
def test_clopper_pearson(successes, trials, confidence):
    def valid(interval):
        low, high = interval
        assert 0.0 <= low <= high <= 1.0

    assert_rule(
        lambda: metrics.clopper_pearson(successes, trials, confidence),
        ["successes", "trials", "confidence"],
        valid,
    )


@rule_settings(25)
@given(bad_arrays((6,)), bad_arrays((6,)))
def test_accuracy(predicted, labels):
    assert_rule(
        lambda: metrics.accuracy(predicted, labels), ["predicted", "labels"], _rate
    )


@rule_settings(25)
@given(bad_arrays((5, 3)), bad_arrays((5,)))
def test_coverage_and_set_size(sets, labels):
    assert_rule(lambda: metrics.coverage(sets, labels), ["sets", "labels"], _rate)

    def size(value):
        assert 0.0 <= value <= sets.shape[1]

    assert_rule(lambda: metrics.mean_set_size(sets), ["sets"], size)


@rule_settings(25)
@given(bad_arrays((4, 3)), bad_arrays((4,)), bad_reals())
def test_true_class_logit(scores, labels, floor):
    def valid(values):
        assert values.shape == (scores.shape[0],)

    assert_rule(
        lambda: metrics.true_class_logit(scores, labels, floor),
        ["scores", "labels", "floor"],
        valid,
    )


@rule_settings(25)
@given(bad_arrays((20,)), st.lists(bad_reals(), min_size=0, max_size=4))
def test_stratified_split(y, fractions):
    def valid(parts):
        joined = np.concatenate(parts)
        assert np.unique(joined).size == joined.size == np.asarray(y).size

    assert_rule(
        lambda: data.stratified_split(y, fractions, np.random.default_rng(0)),
        ["y", "fractions"],
        valid,
    )


@rule_settings(25)
@given(bad_reals(), bad_reals(), bad_reals(), bad_reals())
def test_generators(n_classes, dim, per_class, spread):
    def identities(result):
        dataset, prototypes = result
        assert prototypes.shape == (dataset.n_classes, dataset.X.shape[1])
        assert dataset.y.max() < dataset.n_classes

    params = ["n_classes", "dim", "per_class", "spread"]
    assert_rule(
        lambda: data.make_identities(
            np.random.default_rng(0),
            n_classes=n_classes,
            dim=dim,
            per_class=per_class,
            spread=spread,
        ),
        params,
        identities,
    )

    def fine(dataset):
        assert dataset.coarse is not None
        assert dataset.coarse.shape == dataset.y.shape

    assert_rule(
        lambda: data.make_coarse_to_fine(
            np.random.default_rng(0), n_coarse=n_classes, dim=dim, per_class=per_class
        ),
        ["n_coarse", "dim", "per_class"],
        fine,
    )


@rule_settings(25)
@given(bad_arrays((3, 2)), bad_arrays((3,)), bad_reals())
def test_dataset(X, y, n_classes):
    assert_rule(
        lambda: data.Dataset(X, y, "d", n_classes),
        ["X", "y", "n_classes", "labels", "Dataset"],
    )


@rule_settings(25)
@given(bad_arrays((4, 2)), st.one_of(bad_reals(), st.none()))
def test_query_oracle(queries, budget):
    def model(x):
        return np.full((x.shape[0], 2), 0.5)

    def answers(result):
        assert result.shape == (queries.shape[0], 2)

    def ask(oracle):
        try:
            return oracle(queries)
        except QueryBudgetExceeded:  # the budget holding is a valid outcome
            return np.full((queries.shape[0], 2), 0.5)

    oracle = assert_rule(lambda: QueryOracle(model, budget=budget), ["budget"])
    if oracle is not None:
        assert_rule(lambda: ask(oracle), ["queries"], answers)
