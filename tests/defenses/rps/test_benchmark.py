"""The measurement benchmarks run on tiny settings and report sane numbers."""

import numpy as np

from defenses.rps.benchmark import coverage_study, performance, tradeoff


def test_coverage_study_covers():
    rows = list(
        coverage_study({"n_train_parts": 5, "n_calib_parts": 2, "n_splits": 3}, [0])
    )
    variants = {r.defense for r in rows}
    assert variants == {"exact", "official", "markov", "none"}
    covered = [r.utility["coverage"] for r in rows if r.defense == "exact"]
    assert np.mean(covered) >= 0.85
    assert all(r.params["benchmark"]["confidence_level"] == 0.9 for r in rows)


def test_tradeoff_and_performance_run():
    (row,) = tradeoff(
        {"n_train_parts": 5, "n_calib_parts": 2, "radii": [1], "confidence_level": 0.8},
        [0],
    )
    assert 0.75 <= row.utility["coverage"] <= 1.0
    assert 0.0 <= row.certificate["robust_rt1"] <= 1.0
    rows = list(
        performance(
            {"n_points": 200, "n_train_parts": 3, "n_calib_parts": 2, "repeats": 1},
            [0],
        )
    )
    assert [r.defense for r in rows] == ["none", "certify", "predict_set+certify"]
    assert all(r.cost["time_s"] > 0 for r in rows)
