import numpy as np
import pytest

from defenses.composition.benchmark.shielded_federated import shielded_federated


def test_shield_keeps_the_dp_certificate_and_reports_its_cost():
    runs = list(
        shielded_federated({"rounds": 4, "sigma": 1.0, "epsilons": [0.05, 1.0]}, [0])
    )
    assert [r.defense for r in runs] == [
        "none",
        "ssd(epsilon=0.05)",
        "ssd(epsilon=1.0)",
    ]
    base, small, large = runs
    for run in runs:
        assert run.certificate == base.certificate
        assert run.certificate["eps_strict"] <= 1.0
        assert 0.0 <= run.success["auc"] <= 1.0
    assert base.utility["l1_distortion"] == 0.0
    assert base.utility["argmax_agreement"] == 1.0
    assert 0.0 < small.utility["l1_distortion"] < large.utility["l1_distortion"] <= 2.0
    assert small.utility["argmax_agreement"] >= large.utility["argmax_agreement"]


def test_same_seed_same_numbers():
    a = list(shielded_federated({"rounds": 4, "sigma": 1.0, "epsilons": [0.2]}, [1]))
    b = list(shielded_federated({"rounds": 4, "sigma": 1.0, "epsilons": [0.2]}, [1]))
    for x, y in zip(a, b, strict=True):
        assert x.utility == y.utility
        np.testing.assert_equal(x.success, y.success)


def test_unknown_parameters_are_refused():
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['epsilon'\]"):
        list(shielded_federated({"epsilon": 1.0}, [0]))
