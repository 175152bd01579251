import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from sklearn.metrics import roc_auc_score, roc_curve

from defenses import metrics


def tied_scores(rng, n, levels):
    scores = rng.integers(0, levels, n).astype(float)
    truth = rng.random(n) < 0.4
    truth[:2] = [True, False]
    return scores, truth


def brute_force_roc(scores, truth):
    """(FPR, TPR) at every distinct threshold, highest first, from (0, 0)."""
    fpr, tpr = [0.0], [0.0]
    for threshold in np.unique(scores)[::-1]:
        flagged = scores >= threshold
        fpr.append(flagged[~truth].mean())
        tpr.append(flagged[truth].mean())
    return np.array(fpr), np.array(tpr)


def brute_force_auc(scores, truth):
    """P(s+ > s-) + P(s+ = s-) / 2 over every (positive, negative) pair."""
    pos, neg = scores[truth][:, None], scores[~truth][None, :]
    return float(np.mean((pos > neg) + 0.5 * (pos == neg)))


@pytest.mark.parametrize("levels", [2, 3, 10, 1000])
@pytest.mark.parametrize("seed", range(5))
def test_auc_and_roc_with_heavy_ties_match_brute_force(levels, seed):
    rng = np.random.default_rng(seed)
    scores, truth = tied_scores(rng, 300, levels)
    assert metrics.auc(scores, truth) == pytest.approx(brute_force_auc(scores, truth))
    assert metrics.auc(scores, truth) == pytest.approx(roc_auc_score(truth, scores))
    fpr, tpr = metrics.roc(scores, truth)
    ref_fpr, ref_tpr = brute_force_roc(scores, truth)
    np.testing.assert_allclose(fpr, ref_fpr)
    np.testing.assert_allclose(tpr, ref_tpr)
    sk_fpr, sk_tpr, _ = roc_curve(truth, scores, drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr)
    np.testing.assert_allclose(tpr, sk_tpr)


@pytest.mark.parametrize("trials", [1, 2, 7, 50, 1000])
@pytest.mark.parametrize("confidence", [0.5, 0.9, 0.95, 0.999])
def test_clopper_pearson_equals_the_beta_quantiles(trials, confidence):
    a = 1 - confidence
    for successes in sorted({0, 1, trials // 3, trials - 1, trials}):
        low, high = metrics.clopper_pearson(successes, trials, confidence)
        ref_low = (
            0.0
            if successes == 0
            else stats.beta.ppf(a / 2, successes, trials - successes + 1)
        )
        ref_high = (
            1.0
            if successes == trials
            else stats.beta.ppf(1 - a / 2, successes + 1, trials - successes)
        )
        assert low == pytest.approx(ref_low, abs=1e-10)
        assert high == pytest.approx(ref_high, abs=1e-10)
    assert metrics.clopper_pearson(
        np.int64(3), np.int64(10)
    ) == metrics.clopper_pearson(3, 10)


@pytest.mark.parametrize("trials", [1, 3, 40, 400])
def test_clopper_pearson_equals_scipy_binomtest(trials):
    for successes in sorted({0, 1, trials // 2, trials - 1, trials}):
        exact = stats.binomtest(successes, trials).proportion_ci(
            confidence_level=0.95, method="exact"
        )
        low, high = metrics.clopper_pearson(successes, trials, 0.95)
        assert low == pytest.approx(exact.low, abs=1e-12)
        assert high == pytest.approx(exact.high, abs=1e-12)


def test_tied_scores_cannot_fake_a_low_fpr_point():
    scores = np.zeros(200)
    truth = np.r_[np.ones(100, bool), np.zeros(100, bool)]
    assert metrics.tpr_at_fpr(scores, truth, 0.01) == 0.0
    assert metrics.auc(scores, truth) == 0.5
    assert metrics.advantage(scores, truth) == 0.0


def test_perfect_separation():
    scores = np.r_[np.ones(50), np.zeros(50)]
    truth = scores.astype(bool)
    assert metrics.membership_metrics(scores, truth) == {
        "auc": 1.0,
        "advantage": 1.0,
        "tpr@1%fpr": 1.0,
        "tpr@0.1%fpr": 1.0,
    }


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=4, max_size=60),
    st.integers(0, 2**32 - 1),
)
def test_tpr_at_fpr_matches_brute_force(values, seed):
    rng = np.random.default_rng(seed)
    scores = np.asarray(values, float)
    truth = rng.random(scores.size) < 0.5
    truth[:2] = [True, False]
    for target in (0.0, 0.1, 0.5, 1.0):
        best = 0.0
        for threshold in np.r_[np.unique(scores), np.inf]:
            flagged = scores >= threshold
            fpr = flagged[~truth].mean()
            if fpr <= target + 1e-12:
                best = max(best, flagged[truth].mean())
        assert metrics.tpr_at_fpr(scores, truth, target) == pytest.approx(best)


def test_epsilon_lower_bound_formula_and_confidence():
    assert metrics.epsilon_lower_bound(0.5, 0.1, 0.0) == pytest.approx(
        max(math.log(0.5 / 0.1), math.log(0.9 / 0.5))
    )
    assert metrics.epsilon_lower_bound(0.3, 0.3, 0.0) == 0.0
    with_counts = metrics.epsilon_lower_bound(0.5, 0.1, 0.0, n_pos=100, n_neg=100)
    assert 0 < with_counts < math.log(5)
    assert metrics.epsilon_lower_bound(0.5, 0.0, 0.0) == math.inf


def test_clopper_pearson_matches_known_values():
    low, high = metrics.clopper_pearson(5, 10)
    assert low == pytest.approx(0.187086, abs=1e-5)
    assert high == pytest.approx(0.812914, abs=1e-5)
    assert metrics.clopper_pearson(0, 10)[0] == 0.0
    assert metrics.clopper_pearson(10, 10)[1] == 1.0


def test_coverage_accuracy_and_set_size():
    sets = np.array([[True, False, True], [False, False, True], [True, True, True]])
    labels = np.array([0, 1, 2])
    assert metrics.coverage(sets, labels) == pytest.approx(2 / 3)
    assert metrics.mean_set_size(sets) == pytest.approx(2.0)
    assert metrics.accuracy(np.array([0, 1, 1]), labels) == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: metrics.auc([0.1, np.nan], [True, False]), "finite"),
        (lambda: metrics.auc([0.1, 0.2, 0.3], [True, False]), "same length"),
        (lambda: metrics.auc([0.1, 0.2], [True, True]), "both positives and negatives"),
        (lambda: metrics.auc([0.1, 0.2], [2, 0]), "boolean or 0/1"),
        (
            lambda: metrics.tpr_at_fpr([0.1, 0.2], [1, 0], 1.5),
            r"fpr must be a finite number in",
        ),
        (
            lambda: metrics.epsilon_lower_bound(1.2, 0.1, 0.0),
            "tpr must be a finite number",
        ),
        (
            lambda: metrics.epsilon_lower_bound(0.5, 0.1, 1.0),
            "delta must be a finite number",
        ),
        (lambda: metrics.epsilon_lower_bound(0.5, 0.1, 0, n_pos=10), "both n_pos"),
        (lambda: metrics.clopper_pearson(11, 10), "successes must lie"),
        (lambda: metrics.accuracy([], []), "empty"),
        (lambda: metrics.coverage(np.ones((2, 2)), [0, 1]), "boolean"),
        (lambda: metrics.coverage(np.ones((2, 2), bool), [0, 2]), "labels must be"),
    ],
)
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_true_class_logit():
    scores = np.array([[0.5, 0.5], [0.1, 0.9], [0.0, 1.0]])
    values = metrics.true_class_logit(scores, np.array([0, 1, 1]), floor=1e-6)
    assert values[0] == pytest.approx(0.0)
    assert values[1] == pytest.approx(np.log(9))
    assert values[2] == pytest.approx(np.log((1 - 1e-6) / 1e-6))
    with pytest.raises(
        ValueError, match=r"floor must be a finite number in \[1e-15, 0.5\)"
    ):
        metrics.true_class_logit(scores, np.array([0, 1, 1]), floor=0.6)
    with pytest.raises(ValueError, match="labels"):
        metrics.true_class_logit(scores, np.array([0, 1]))
