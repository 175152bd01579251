"""The epsilon bound of an attack equals the best of defenses.metrics' bounds."""

import numpy as np
import pytest

from defenses.audit.leakage import epsilon_bound, membership_success
from defenses.metrics import epsilon_lower_bound, membership_metrics, roc


@pytest.mark.parametrize(
    ("shift", "rounded"), [(0.0, False), (1.5, False), (1.0, True)]
)
def test_epsilon_bound_is_the_best_threshold_bound(shift, rounded):
    rng = np.random.default_rng(int(shift * 10) + rounded)
    n_pos, n_neg = 40, 60
    scores = np.r_[rng.normal(shift, 1, n_pos), rng.normal(0, 1, n_neg)]
    if rounded:
        scores = np.round(scores)
    truth = np.r_[np.ones(n_pos, bool), np.zeros(n_neg, bool)]
    fprs, tprs = roc(scores, truth)
    brute = max(
        epsilon_lower_bound(t, f, 1e-5, n_pos, n_neg, 0.95)
        for f, t in zip(fprs, tprs, strict=True)
    )
    assert epsilon_bound(fprs, tprs, n_pos, n_neg, 1e-5, 0.95) == brute
    metrics, (f, t) = membership_success(scores, truth, 1e-5, 0.95)
    assert metrics["eps_lb"] == brute
    assert {k: metrics[k] for k in membership_metrics(scores, truth)} == (
        membership_metrics(scores, truth)
    )
    assert np.array_equal(f, fprs)
    assert np.array_equal(t, tprs)
    if shift >= 1.5:
        assert brute > 0.5
