"""Offline LiRA: the shadows' split, the statistic, and the executors."""

import numpy as np
import pytest

from defenses.audit.attacks import OfflineLiRA, ShadowScores, lira_scores
from defenses.audit.examples import build_mlp
from defenses.audit.shadows import ShadowConfig, inclusion, train_shadows
from defenses.parallel import map_jobs


@pytest.mark.parametrize("n_shadows", [2, 3, 4, 7])
def test_every_candidate_is_in_half_the_shadows(n_shadows):
    mask = inclusion(n_shadows, 500, np.random.default_rng(0))
    assert mask.shape == (n_shadows, 500)
    assert np.all(mask.sum(axis=0) == n_shadows // 2)
    # shadows differ: each sees a different random half
    assert len({row.tobytes() for row in mask}) == n_shadows


def test_lira_statistic_is_the_out_z_score():
    trained_on = np.array([[True, False, False], [False, True, False]])
    phi = np.array([[5.0, 1.0, 2.0], [3.0, 7.0, 4.0]])
    bank = ShadowScores(trained_on, phi)
    target = np.array([6.0, 6.0, 3.0])
    # out-shadows: candidate 0 -> [3], 1 -> [1], 2 -> [2, 4]
    mu = np.array([3.0, 1.0, 3.0])
    residuals = np.array([0.0, 0.0, -1.0, 1.0])
    expected = (target - mu) / residuals.std()
    assert np.allclose(lira_scores(target, bank), expected)
    with pytest.raises(ValueError, match="left it out"):
        lira_scores(target, ShadowScores(np.ones((2, 3), bool), phi))


def _square(x):
    return x * x


def test_serial_and_process_executors_agree():
    jobs = list(range(5))
    assert map_jobs(_square, jobs) == [0, 1, 4, 9, 16]
    assert map_jobs(_square, jobs, "process", n_jobs=1) == [0, 1, 4, 9, 16]
    with pytest.raises(ValueError, match="executor"):
        map_jobs(_square, jobs, "threads")
    with pytest.raises(ValueError, match="n_jobs"):
        map_jobs(_square, jobs, "process", n_jobs=0)
    assert map_jobs(_square, []) == []


def _shadow_bank(executor, n_jobs, cancer):
    _, (X, y), _ = cancer
    return train_shadows(
        build_mlp,
        X,
        y,
        input_shape=(X.shape[1],),
        n_classes=2,
        classes=np.array([0, 1]),
        outputs="auto",
        config=ShadowConfig(n_shadows=2, executor=executor, n_jobs=n_jobs),
        rng=np.random.default_rng(4),
    )


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["process", "ray"])
def test_parallel_shadows_equal_serial_shadows(executor, cancer):
    serial = _shadow_bank("serial", 1, cancer)
    try:
        parallel = _shadow_bank(executor, 2, cancer)
    finally:
        if executor == "ray":
            import ray

            ray.shutdown()
    assert np.array_equal(serial.trained_on, parallel.trained_on)
    assert np.array_equal(serial.phi, parallel.phi)


def test_shadows_see_their_own_half_more_confidently(cancer):
    bank = _shadow_bank("serial", 1, cancer)
    inside = bank.phi[bank.trained_on].mean()
    outside = bank.phi[~bank.trained_on].mean()
    assert inside > outside


@pytest.mark.parametrize("floor", [0.5, 1e-16, -0.1, float("nan"), "0.1"])
def test_offline_lira_rejects_a_floor_outside_the_logit_range(floor):
    with pytest.raises(ValueError, match=r"OfflineLiRA\.floor"):
        OfflineLiRA(floor=floor)
