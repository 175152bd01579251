"""``epsilon`` out of the paper's range: valid, but a very large one warns (issue 40).

Since any two distributions are within L1 distance 2, a row with
``epsilon * H(f) >= 2`` is answered by the bare prototype of its pseudo-label. That
is a meaningful extreme (the limit is a randomized label response), so a large
epsilon is not an error; but 1e6 is more likely a differential-privacy epsilon, so
above ``EPSILON_WARN`` the user is told what the value does.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from defenses.ssd import StealthyShield
from defenses.ssd.budget import entropy
from defenses.ssd.defense import EPSILON_WARN

VAL = np.array([[0.9, 0.05, 0.05], [0.1, 0.8, 0.1], [0.05, 0.15, 0.8]])


@pytest.mark.parametrize("epsilon", [1e-9, 0.35, 1.5, EPSILON_WARN])
def test_paper_range_and_up_to_the_threshold_is_silent(epsilon):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StealthyShield(epsilon=epsilon)


@pytest.mark.parametrize("epsilon", [np.nextafter(EPSILON_WARN, np.inf), 1e6, 1e300])
def test_a_huge_epsilon_warns_with_what_it_does(epsilon):
    with pytest.warns(UserWarning, match=r"epsilon=.*far above the paper") as record:
        StealthyShield(epsilon=epsilon)
    text = str(record[0].message)
    assert f"{2.0 / epsilon:.3g} nats" in text
    assert "not a differential-privacy" in text
    assert record[0].filename == __file__  # points at the caller's line


def test_set_params_warns_too_and_keeps_the_value():
    shield = StealthyShield()
    with pytest.warns(UserWarning, match="epsilon=1000000.0"):
        shield.set_params(epsilon=1e6)
    assert shield.epsilon == 1e6


@pytest.mark.parametrize("epsilon", [0.0, -1.0, np.inf, np.nan, "1"])
def test_non_positive_or_non_finite_is_an_error_naming_it(epsilon):
    with pytest.raises(ValueError, match="epsilon"):
        StealthyShield(epsilon=epsilon)


def test_what_the_warning_says_holds():
    rng = np.random.default_rng(0)
    f = rng.dirichlet(np.ones(3), size=200)
    with pytest.warns(UserWarning, match="far above"):
        shield = StealthyShield(epsilon=1e6, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, when set, not at every fit
        shield.fit(VAL, np.array([0, 1, 2]))
    out = shield(f)
    above = entropy(f) >= 2.0 / 1e6
    assert above.all()
    # each answer is a bare prototype row
    gaps = np.abs(out[:, None, :] - shield.prototypes_[None, :, :]).max(axis=2)
    assert (gaps.min(axis=1) == 0.0).all()
