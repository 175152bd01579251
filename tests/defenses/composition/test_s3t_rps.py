"""S3T shards as RPS parts: sets, certificates, exact deletion, empirical soundness."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import pytest

from defenses.composition.benchmark.s3t_rps import s3t_rps, split_conformal
from defenses.composition.s3t_rps import ReliableUnlearner, ShardVoter
from defenses.metrics import coverage, mean_set_size
from defenses.registry import available
from defenses.rps import ReliableConformalClassifier
from defenses.rps.defense import NotFittedError as RPSNotFitted
from defenses.s3t import S3T, SISA, NotFittedError, twin_test
from tests.tiny_digits import TinyDigits, tiny_digits

ALPHA = 0.1
SHARDS = 8


@pytest.fixture(scope="module")
def task() -> TinyDigits:
    return tiny_digits(public=200, pool=500, calibration=300, test=300, n_blocks=2)


def _s3t(task: TinyDigits) -> S3T:
    return S3T(task.backbone, SHARDS, 2, epochs=4, rank=4, lr=3e-2, batch_size=32)


def _build(
    task: TinyDigits,
    labels: np.ndarray | None = None,
    keep: np.ndarray | None = None,
    deleted: Sequence[int] = (),
) -> ReliableUnlearner:
    """Fit on the pool (relabelled, restricted), delete ``deleted``, conformalize."""
    rows = np.ones(task.ids.size, dtype=bool) if keep is None else keep
    y = task.y if labels is None else labels
    model = ReliableUnlearner(_s3t(task), n_calib_parts=5, confidence_level=1 - ALPHA)
    model.fit(task.X[rows], y[rows], task.ids[rows])
    if len(deleted):
        model.delete(list(deleted))
    return model.conformalize(task.cal_X, task.cal_y)


@pytest.fixture(scope="module")
def fitted(task: TinyDigits) -> ReliableUnlearner:
    return _build(task)


@pytest.fixture
def model(fitted: ReliableUnlearner) -> ReliableUnlearner:
    return copy.deepcopy(fitted)


def _ids_in(fitted: ReliableUnlearner, task: TinyDigits, shard: int) -> list[int]:
    """One id of each slice of ``shard`` (located in the undeleted model)."""
    out: dict[int, int] = {}
    for i, (s, j) in zip(task.ids, fitted.unlearner.locate(task.ids), strict=True):
        if s == shard:
            out.setdefault(j, int(i))
    return list(out.values())


def _assert_certified_kept(
    before: ReliableUnlearner, after: ReliableUnlearner, X: np.ndarray, radius: int
) -> int:
    """Every (point, class) certified at ``radius`` before keeps its membership."""
    cert = before.certify(X)
    certified = cert.certified(radius, 0)
    sets = after.predict_set(X)[1][:, :, 0]
    assert certified.any()
    changed = certified & (sets != cert.sets)
    assert not changed.any(), f"{int(changed.sum())} certified memberships changed"
    return int(certified.sum())


def test_sets_and_certificates_are_rps_on_the_shard_votes(
    task: TinyDigits, fitted: ReliableUnlearner
) -> None:
    votes = fitted.part_votes(task.test_X)
    assert votes.shape == (SHARDS, task.test_y.size)
    assert votes.min() >= 0
    direct = ReliableConformalClassifier.from_voter(
        ShardVoter(fitted.unlearner),
        np.arange(10),
        64,
        n_calib_parts=5,
        confidence_level=1 - ALPHA,
    ).conformalize(task.cal_X, task.cal_y)
    sets = fitted.predict_set(task.test_X)[1][:, :, 0]
    cert = fitted.certify(task.test_X)
    assert sets.shape == (task.test_y.size, 10)
    assert np.array_equal(sets, direct.predict_set(task.test_X)[1][:, :, 0])
    assert np.array_equal(cert.sets, sets)
    assert np.array_equal(cert.training, direct.certify(task.test_X).training)
    assert np.array_equal(
        fitted.rps.predict_votes(task.test_X).sum(axis=1),
        np.full(task.test_y.size, SHARDS),
    )
    assert cert.max_train_radius == SHARDS
    assert (cert.training >= 0).all()
    assert cert.robust(1, 0).mean() > 0.2
    one = sets.sum(axis=1) == 1
    assert np.array_equal(
        np.argmax(sets[one], axis=1),
        np.argmax(fitted.rps.predict_votes(task.test_X[one]), axis=1),
    )


def test_clean_coverage_is_near_the_confidence_level(
    task: TinyDigits, fitted: ReliableUnlearner
) -> None:
    sets = fitted.predict_set(task.test_X)[1][:, :, 0]
    assert coverage(sets, task.test_y) >= 1 - ALPHA - 0.05
    assert mean_set_size(sets) < 2.0
    assert fitted.rps.miscoverage_bound_ <= ALPHA + 1e-9


def test_deletion_serves_what_a_model_trained_without_the_ids_serves(
    task: TinyDigits, model: ReliableUnlearner
) -> None:
    deleted = [int(i) for i in task.ids[[3, 40, 41, 250, 499]]]
    slots = model.unlearner.locate(deleted)
    model.delete(deleted)
    keep = ~np.isin(task.ids, deleted)
    twin = _build(task, keep=keep)
    twin.deactivate(slots)
    X = task.test_X
    assert np.array_equal(model.part_votes(X), twin.part_votes(X))
    assert np.array_equal(
        model.unlearner.predict_proba(X), twin.unlearner.predict_proba(X)
    )
    a, b = model.certify(X), twin.certify(X)
    assert np.array_equal(a.sets, b.sets)
    assert np.array_equal(a.training, b.training)
    assert np.array_equal(a.calibration, b.calibration)
    model.retrain()
    fresh = _build(task, keep=keep)
    assert np.array_equal(model.part_votes(X), fresh.part_votes(X))
    assert np.array_equal(model.certify(X).training, fresh.certify(X).training)
    assert np.array_equal(
        model.predict_set(X)[1][:, :, 0], fresh.predict_set(X)[1][:, :, 0]
    )


def test_the_shards_pass_the_s3t_twin_test(task: TinyDigits) -> None:
    def factory() -> S3T:
        return S3T(task.backbone, 4, 2, epochs=2, rank=2, lr=3e-2, batch_size=32)

    report = twin_test(factory, task.X, task.y, task.ids, int(task.ids[7]), task.test_X)
    assert report.exact
    assert report.switched_off_differed


def _targeted_flips(
    model: ReliableUnlearner, task: TinyDigits, radius: int
) -> np.ndarray:
    """Relabel ``radius`` training points in distinct shards near a fragile point.

    The target is a test point whose top-voted class is in its set, certified at
    ``radius``, with the least vote margin; its nearest training neighbours of that
    class, one per shard, move to its runner-up class.
    """
    cert = model.certify(task.test_X)
    votes = model.rps.predict_votes(task.test_X)
    top_class = np.argmax(votes, axis=1)
    rows = np.arange(top_class.size)
    held = cert.sets[rows, top_class] & (cert.training[rows, top_class] >= radius)
    candidates = np.flatnonzero(held)
    ranked = np.sort(votes[candidates], axis=1)
    target = int(candidates[np.argmin(ranked[:, -1] - ranked[:, -2])])
    top, runner = np.argsort(votes[target])[::-1][:2]
    shards = [s for s, _ in model.unlearner.locate(task.ids)]
    labels = task.y.copy()
    used: set[int] = set()
    for row in np.argsort(np.linalg.norm(task.X - task.test_X[target], axis=1)):
        if labels[row] == top and shards[row] not in used:
            labels[row] = runner
            used.add(shards[row])
        if len(used) == radius:
            break
    assert len(used) == radius
    return labels


def _shard_flips(model: ReliableUnlearner, task: TinyDigits, radius: int) -> np.ndarray:
    """Relabel every training point of shards 0 .. radius-1 (to label + 1)."""
    shards = np.array([s for s, _ in model.unlearner.locate(task.ids)])
    labels = task.y.copy()
    hit = shards < radius
    labels[hit] = (labels[hit] + 1) % 10
    return labels


@pytest.mark.parametrize("radius", [1, 2])
def test_certified_memberships_survive_targeted_label_flips(
    task: TinyDigits, fitted: ReliableUnlearner, radius: int
) -> None:
    labels = _targeted_flips(fitted, task, radius)
    poisoned = _build(task, labels=labels)
    votes_before = fitted.part_votes(task.test_X)
    votes_after = poisoned.part_votes(task.test_X)
    changed = np.flatnonzero((votes_before != votes_after).any(axis=1))
    assert 0 < changed.size <= radius
    _assert_certified_kept(fitted, poisoned, task.test_X, radius)


def test_certified_memberships_survive_whole_shards_relabelled(
    task: TinyDigits, fitted: ReliableUnlearner
) -> None:
    labels = _shard_flips(fitted, task, 2)
    poisoned = _build(task, labels=labels)
    changed = (fitted.part_votes(task.test_X) != poisoned.part_votes(task.test_X)).any(
        axis=1
    )
    assert changed[:2].all()
    assert not changed[2:].any()
    assert (
        poisoned.predict_set(task.test_X)[1][:, :, 0]
        != fitted.predict_set(task.test_X)[1][:, :, 0]
    ).any()
    _assert_certified_kept(fitted, poisoned, task.test_X, 2)


def test_a_dead_shard_abstains_and_the_certificate_still_holds(
    task: TinyDigits, fitted: ReliableUnlearner, model: ReliableUnlearner
) -> None:
    victims = _ids_in(fitted, task, 0)
    receipt = model.delete(victims)
    assert receipt.dead_shards == (0,)
    assert model.dead_shards == (0,)
    votes = model.part_votes(task.test_X)
    assert (votes[0] == -1).all()
    assert (votes[1:] >= 0).all()
    assert np.array_equal(
        model.rps.predict_votes(task.test_X).sum(axis=1),
        np.full(task.test_y.size, SHARDS - 1),
    )
    assert (
        coverage(model.predict_set(task.test_X)[1][:, :, 0], task.test_y)
        >= 1 - ALPHA - 0.05
    )
    labels = _shard_flips(fitted, task, 2)
    poisoned = _build(task, labels=labels, deleted=victims)
    assert poisoned.dead_shards == (0,)
    assert (
        model.part_votes(task.test_X)[1] != poisoned.part_votes(task.test_X)[1]
    ).any()
    _assert_certified_kept(model, poisoned, task.test_X, 1)


def test_further_deletions_within_the_radius_keep_certified_memberships(
    task: TinyDigits, fitted: ReliableUnlearner, model: ReliableUnlearner
) -> None:
    for shard in (2, 5):
        model.delete(_ids_in(fitted, task, shard))
    assert model.dead_shards == (2, 5)
    _assert_certified_kept(fitted, model, task.test_X, 2)


def test_sisa_shards_work_too(task: TinyDigits) -> None:
    sisa = SISA(task.backbone, 4, 2, epochs=2, rank=2, lr=3e-2, batch_size=32)
    model = ReliableUnlearner(sisa, n_calib_parts=5, confidence_level=1 - ALPHA)
    model.fit(task.X, task.y, task.ids).conformalize(task.cal_X, task.cal_y)
    assert model.certify(task.test_X).max_train_radius == 4
    model.delete([int(task.ids[0])])
    assert model.predict_set(task.test_X)[1][:, :, 0].shape == (task.test_y.size, 10)


def test_misuse_is_refused(task: TinyDigits, fitted: ReliableUnlearner) -> None:
    with pytest.raises(ValueError, match="Unlearner"):
        ShardVoter(object())  # type: ignore[arg-type]
    with pytest.raises(NotFittedError):
        ReliableUnlearner(_s3t(task), n_calib_parts=5).conformalize(
            task.cal_X, task.cal_y
        )
    with pytest.raises(ValueError, match="confidence_level"):
        ReliableUnlearner(_s3t(task), confidence_level=1.5)
    uncalibrated = ReliableUnlearner(copy.deepcopy(fitted.unlearner))
    with pytest.raises(RPSNotFitted):
        uncalibrated.predict_set(task.test_X)


TINY_BENCH = {
    "shards": 4,
    "slices": 2,
    "n_calib_parts": 5,
    "deletions": 4,
    "radii": 2,
    "public": 100,
    "width": 16,
    "hidden": 16,
    "blocks": 2,
    "pretrain_epochs": 2,
    "epochs": 2,
}


def test_the_benchmark_reports_every_variant_and_retraining_is_exact() -> None:
    runs = list(s3t_rps(TINY_BENCH, [0]))
    names = [r.defense for r in runs]
    assert names == [
        "s3t-rps(before)",
        "s3t-cp(before)",
        "s3t-rps(after)",
        "s3t-cp(after)",
        "s3t-rps(retrained)",
        "s3t-rps(rebuilt)",
    ]
    by = dict(zip(names, runs, strict=True))
    assert by["s3t-rps(retrained)"].utility["matches_rebuilt"] == 1.0
    for name in ("s3t-rps(retrained)", "s3t-rps(rebuilt)"):
        assert by[name].utility["dead_shards"] == 0.0
    assert by["s3t-rps(retrained)"].certificate == by["s3t-rps(rebuilt)"].certificate
    after = by["s3t-rps(after)"]
    assert after.utility["deleted"] == 4.0
    assert 0.0 < after.utility["served_fraction"] < 1.0
    assert set(after.certificate) == {
        "robust_fraction@rt1",
        "robust_fraction@rt2",
        "miscoverage_bound",
    }
    assert after.cost["deletion_s"] > 0.0
    assert by["s3t-cp(after)"].certificate == {}
    for run in runs:
        assert 0.0 <= run.utility["coverage"] <= 1.0
    assert "composition-s3t-rps" in available("benchmarks")


def test_the_benchmark_refuses_bad_parameters() -> None:
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['shard'\]"):
        list(s3t_rps({"shard": 3}, [0]))
    with pytest.raises(ValueError, match="unlearner"):
        list(s3t_rps({"unlearner": "retrain"}, [0]))
    with pytest.raises(ValueError, match="confidence_level"):
        list(s3t_rps({"confidence_level": 1.0}, [0]))
    with pytest.raises(ValueError, match="deletions"):
        list(s3t_rps({"deletions": 0}, [0]))


def test_split_conformal_covers_at_the_confidence_level() -> None:
    rng = np.random.default_rng(1)
    proba = rng.dirichlet(np.full(5, 0.5), size=4000)
    labels = np.array([rng.choice(5, p=p) for p in proba])
    cal, test = slice(0, 1000), slice(1000, None)
    sets = split_conformal(proba[cal], labels[cal], proba[test], 0.9)
    assert abs(coverage(sets, labels[test]) - 0.9) < 0.03
    with pytest.raises(ValueError, match="calibration points"):
        split_conformal(proba[:5], labels[:5], proba, 0.9)
