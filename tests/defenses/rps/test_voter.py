"""RPS on an external ensemble (``from_voter``), with abstaining parts."""

import itertools

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from defenses.rps import PartVoter, ReliableConformalClassifier
from defenses.rps.ensemble import predict_parts
from defenses.rps.partition import part_of, partition
from defenses.rps.scores import smoothed_scores


class TableVoter:
    """Votes looked up by the point id held in feature 0 (a hand-made ensemble)."""

    def __init__(self, table):
        self.table = np.asarray(table, dtype=np.int64)
        self.n_parts = self.table.shape[0]
        self.reads = 0

    def part_votes(self, X):
        self.reads += 1
        return self.table[:, np.asarray(X[:, 0], dtype=np.int64)]


class ModelVoter:
    """The part models of a fitted classifier, seen as a voter."""

    def __init__(self, models):
        self.models = models
        self.n_parts = len(models)

    def part_votes(self, X):
        return predict_parts(self.models, X)


def points(n, k_c=1, salt=0.0):
    """Rows (id, salt): the id indexes the voter's table."""
    X = np.column_stack([np.arange(n, dtype=np.float64), np.full(n, salt)])
    return X, part_of(X, k_c)


def test_voter_protocol_and_an_abstaining_part():
    # part 2 abstains everywhere (a shard whose data were all deleted)
    table = [[0, 0, 1, 1, 2, 2, 0, 1], [0, 1, 1, 2, 2, 0, 0, 1], [-1] * 8]
    voter = TableVoter(table)
    assert isinstance(voter, PartVoter)
    X, _ = points(8)
    model = ReliableConformalClassifier.from_voter(
        voter, ["a", "b", "c"], 2, n_calib_parts=1, confidence_level=0.7
    )
    assert model.n_train_parts == 3
    assert model.predict_votes(X).sum(axis=1).tolist() == [2] * 8
    model.conformalize(X[:6], np.array(["a", "b", "b", "c", "c", "a"]))
    cert = model.certify(X[6:])
    assert np.array_equal(cert.sets, model.predict_set(X[6:])[1][:, :, 0])
    assert cert.sets.shape == (2, 3)
    assert np.all(cert.training <= 3)
    scores = model.predict_scores(X[6:])
    e = np.exp(1 / 3)
    # two parts agree, one abstains: softmax of (2/3, 0, 0) over three classes
    z = e**2 + 2
    assert scores[0].tolist() == pytest.approx([e**2 / z, 1 / z, 1 / z])


def test_votes_are_read_afresh_after_the_parts_change():
    voter = TableVoter([[0, 1, 0, 1, 0, 0], [0, 1, 0, 1, 0, 0], [0, 1, 0, 1, 1, 1]])
    X, _ = points(6)
    model = ReliableConformalClassifier.from_voter(
        voter, [0, 1], 2, 1, confidence_level=0.6
    )
    model.conformalize(X[:4], np.array([0, 1, 0, 1]))
    before = model.predict_set(X[4:])[1][:, :, 0]
    reads = voter.reads
    voter.table[:2, 4:] = 1  # two shards retrained after a deletion
    after = model.predict_set(X[4:])[1][:, :, 0]
    assert voter.reads == reads + 1
    assert before.tolist() == [[False, False]] * 2
    assert after.tolist() == [[False, True]] * 2
    voter.table[:, 5] = -1  # every shard of point 5 lost its data
    assert model.predict_votes(X[4:]).tolist() == [[0, 3], [0, 0]]
    assert model.certify(X[4:]).sets.tolist() == [[False, True], [False, False]]


def test_voter_of_fitted_models_equals_the_fit_path(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    fitted = ReliableConformalClassifier(
        LogisticRegression(max_iter=1000), n_train_parts=6, n_calib_parts=3
    )
    fitted.fit(Xt, yt).conformalize(Xc, yc)
    voter = ModelVoter(fitted.estimators_)
    external = ReliableConformalClassifier.from_voter(
        voter, fitted.classes_, Xt.shape[1], 3, 0.9
    ).conformalize(Xc, yc)
    a, b = fitted.certify(Xs), external.certify(Xs)
    assert np.array_equal(a.sets, b.sets)
    assert np.array_equal(a.training, b.training)
    assert np.array_equal(a.calibration, b.calibration)
    assert np.array_equal(a.joint, b.joint)


def test_bad_voters():
    voter = TableVoter([[0, 1, 2], [1, 1, -1]])
    X, _ = points(3)
    build = ReliableConformalClassifier.from_voter
    with pytest.raises(ValueError, match="sorted and distinct"):
        build(voter, [2, 1, 0], 2)
    with pytest.raises(ValueError, match="at least 2 labels"):
        build(voter, [0], 2)
    with pytest.raises(TypeError, match="part_votes"):
        build(object(), [0, 1], 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_features"):
        build(voter, [0, 1, 2], 0)
    with pytest.raises(ValueError, match="confidence_level"):
        build(voter, [0, 1, 2], 2, confidence_level=1.5)
    model = build(voter, [0, 1, 2], 2, 1, 0.5)
    with pytest.raises(ValueError, match="fit does not apply"):
        model.fit(X, [0, 1, 2])
    with pytest.raises(ValueError, match="features"):
        model.predict_votes(X[:, :1])
    with pytest.raises(ValueError, match="predictions must lie"):
        build(voter, [0, 1], 2, 1, 0.5).predict_votes(X)
    voter.n_parts = 3
    with pytest.raises(ValueError, match="must stay fixed"):
        model.predict_votes(X)
    voter.n_parts = 2
    voter.table = voter.table[:1]
    with pytest.raises(ValueError, match="shape"):
        model.predict_votes(X)
    voter.table = np.zeros((2, 3)) + 0.5
    with pytest.raises(ValueError, match="integers"):
        model.predict_votes(X)


def poisoned_sets(model, votes, cal, y_cal, test, parts):
    """Reference majority sets for a stack of vote tables, shape (M, k_t, n)."""
    k_t, n_classes = model.n_train_parts, model.n_classes
    counts = (votes[..., None] == np.arange(n_classes)).sum(axis=1)
    m, n = counts.shape[:2]
    scores = smoothed_scores(
        counts.reshape(m * n, n_classes), k_t, model.softmax, abstain=True
    ).reshape(m, n, n_classes)
    true = scores[:, cal, y_cal]
    held = np.zeros((m, len(test), n_classes), dtype=np.int64)
    for members, rank in zip(parts, model.ranks_, strict=True):
        tau = np.sort(true[:, members], axis=1)[:, rank - 1]
        held += scores[:, test] >= tau[:, None, None]
    return held > model.tau_hat_


def changes(base, r, n_classes):
    """Every table differing from ``base`` in exactly ``r`` parts (abstain included)."""
    k_t, n = base.shape
    states = np.array(
        list(itertools.product(range(-1, n_classes), repeat=n)), dtype=np.int8
    )
    for chosen in itertools.combinations(range(k_t), r):
        grids = np.meshgrid(*[np.arange(len(states))] * r, indexing="ij")
        picks = [g.ravel() for g in grids]
        out = np.broadcast_to(base, (picks[0].size, k_t, n)).copy()
        for part, pick in zip(chosen, picks, strict=True):
            out[:, part] = states[pick]
        yield out


def every_change_keeps_certified(base, y_cal, X, n_cal, k_c, alpha, radii, softmax):
    """Check one instance against every change of r parts; count what moved."""
    n_classes = int(max(base.max(), y_cal.max())) + 1
    cal, test = np.arange(n_cal), np.arange(n_cal, base.shape[1])
    model = ReliableConformalClassifier.from_voter(
        TableVoter(base), np.arange(n_classes), 2, k_c, 1 - alpha, softmax=softmax
    ).conformalize(X[cal], y_cal)
    cert = model.certify(X[test])
    parts = partition(X[cal], y_cal, k_c)
    reference = poisoned_sets(model, base[None], cal, y_cal, test, parts)[0]
    assert np.array_equal(reference, cert.sets)
    certified = changed = 0
    for r in radii:
        safe = cert.training >= r
        for tables in changes(base, r, n_classes):
            after = poisoned_sets(model, tables, cal, y_cal, test, parts)
            moved = after != cert.sets[None]
            assert not np.any(moved & safe[None]), (r, base.tolist())
            changed += int(moved.any(axis=(1, 2)).sum())
        certified += int(safe.sum())
    return certified, changed


@pytest.mark.parametrize(
    ("n_classes", "k_t", "n_cal", "n_test", "k_c", "alpha", "radii", "bases"),
    [
        (2, 3, 3, 2, 1, 0.3, (1, 2), 3),
        (3, 4, 2, 1, 1, 0.4, (1, 2), 3),
        (2, 3, 4, 1, 2, 0.5, (1, 2), 3),
        pytest.param(2, 3, 3, 2, 1, 0.3, (1, 2), 16, marks=pytest.mark.slow),
        pytest.param(3, 4, 2, 1, 1, 0.4, (1, 2, 3), 8, marks=pytest.mark.slow),
        pytest.param(2, 3, 4, 1, 2, 0.5, (1, 2), 12, marks=pytest.mark.slow),
        pytest.param(2, 4, 3, 1, 1, 0.3, (1, 2, 3), 8, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("softmax", [True, False])
def test_brute_force_soundness_with_abstentions(
    n_classes, k_t, n_cal, n_test, k_c, alpha, radii, bases, softmax
):
    """Enumerate every change of r parts, each part's votes on every point moving
    freely among the classes and abstain; no certified (point, class) may change."""
    rng = np.random.default_rng(n_classes * 100 + k_t * 10 + k_c)
    n = n_cal + n_test
    salt = 0.0
    while True:  # calibration parts that each hold enough points for their rank
        X, hashed = points(n, k_c, salt)
        if np.bincount(hashed[:n_cal], minlength=k_c).min() >= n_cal // k_c:
            break
        salt += 1.0
    certified = changed = 0
    for trial in range(bases):
        base = rng.integers(-1, n_classes, size=(k_t, n))
        # test points that agree on one class, with some parts abstaining
        abstains = rng.random((k_t, n_test)) < (0.4 if trial % 2 else 0.0)
        base[:, n_cal:] = np.where(abstains, -1, rng.integers(0, n_classes))
        y_cal = rng.integers(0, n_classes, n_cal)
        y_cal[0] = n_classes - 1
        done = every_change_keeps_certified(
            base, y_cal, X, n_cal, k_c, alpha, radii, softmax
        )
        certified, changed = certified + done[0], changed + done[1]
    assert certified > 0
    assert changed > 0


@pytest.mark.parametrize(
    ("base", "y_cal", "radius"),
    [
        ([[1, 0, 1, -1], [0, 1, 1, -1], [-1, -1, 1, -1], [0, 1, 1, -1]], [0, 1, 0], 2),
        ([[0, 1, 1, 0], [0, -1, 0, -1], [0, -1, 0, 0], [0, 0, -1, -1]], [1, 1, 1], 1),
        ([[0, 1, -1, 0], [0, 0, -1, -1], [0, -1, 0, 0], [0, -1, -1, -1]], [1, 0, 1], 1),
        ([[1, 1, -1, -1], [1, 0, 1, 1], [1, 0, -1, 1], [1, 0, 0, -1]], [0, 0, 0], 1),
    ],
)
def test_abstentions_joining_the_runner_up_are_counted(base, y_cal, radius):
    """Instances where a lower bound that ignores abstain -> runner-up moves
    would certify a class that a change of ``radius`` parts removes (found by a
    search against such a bound); the sound bound must not certify it."""
    X, _ = points(4)
    _, changed = every_change_keeps_certified(
        np.array(base), np.array(y_cal), X, 3, 1, 0.3, (radius,), True
    )
    assert changed > 0


def test_shifted_vote_rows_tie_exactly():
    """(2, 1) and (1, 0) of 3 parts have the same softmax; with abstentions both
    occur, and a score may not miss a threshold it equals by one ulp (found by the
    brute force above: a certified class left the set)."""
    scores = smoothed_scores(np.array([[2, 1], [1, 0], [4, 3]]), 7, abstain=True)
    assert scores[0].tolist() == scores[1].tolist() == scores[2].tolist()
    base = np.array([[1, 0, -1, 1, 1], [1, 0, 1, -1, -1], [1, 0, 1, -1, 1]])
    X, _ = points(5)
    certified, changed = every_change_keeps_certified(
        base, np.array([1, 1, 1]), X, 3, 1, 0.3, (1,), True
    )
    assert certified > 0
    assert changed > 0
