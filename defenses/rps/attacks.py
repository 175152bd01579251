"""Poisoning attacks on conformal prediction sets (training-stage branch).

Training label flips (Biggio et al., 2012; the RPS paper's label-flip threat):

* :class:`RandomFlip` - a fraction of training labels flipped to random classes;
* :class:`PairFlip` - a fraction of one class relabelled as another;
* :class:`TargetedFlip` - for each target test point, its ``flips`` nearest training
  neighbours relabelled to the target's runner-up class (per a surrogate model).

Calibration poisoning (cf. Li et al., ICML 2024; Zargarbashi et al., ICML 2024):

* :class:`CalibrationCoverage` - the lowest-score calibration points replaced by
  copies of the highest-score ones: thresholds rise, coverage falls;
* :class:`CalibrationSize` - the highest-score calibration points relabelled to
  their least likely class: thresholds fall, sets grow.

And :class:`WorstCase`, the attack the certificate reasons about, for small
instances: it takes over whole hash parts. For each target it floods
``train_parts`` training parts that vote for the target's true label with copies
of the target labelled as the runner-up, and ``calib_parts`` calibration parts with
copies of the highest-score calibration point, each copy nudged (by 1e-7 steps in
one feature) until its hash lands in the chosen part. The certificate's radius
counts parts, so this is the strongest attack of a given radius against classifiers
that fit their training points.

Surrogates are logistic regressions fitted on the clean training data (the attacker
knows the training data and the algorithm, not the trained system).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_int
from defenses.data import Dataset
from defenses.rps.defense import ReliableConformalClassifier
from defenses.rps.partition import part_of
from defenses.rps.tasks import ConformalTask, checksum
from defenses.threat import Capability

_REPLICAS: dict[tuple[int, int], ReliableConformalClassifier] = {}

TRAIN = frozenset({Capability.POISON_TRAIN})
CALIB = frozenset({Capability.POISON_CALIBRATION})


def _fraction(owner: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= 1
    ):
        raise ValueError(f"{owner}.fraction must lie in (0, 1], got {value!r}")


@dataclass(frozen=True)
class _FractionPoisoner:
    """A poisoner of a ``fraction`` of one split's points, in (0, 1]."""

    fraction: float

    def __post_init__(self) -> None:
        _fraction(type(self).__name__, self.fraction)


def _count(fraction: float, size: int) -> int:
    """Points poisoned out of ``size``: the rounded ``fraction``, at least one."""
    return max(1, round(fraction * size))


def surrogate(train: Dataset) -> LogisticRegression:
    """The attacker's model: a logistic regression on the clean training data."""
    with threadpool_limits(limits=1):
        return LogisticRegression(max_iter=1000).fit(train.X, train.y)


def _proba(model: LogisticRegression, X: FloatArray, n_classes: int) -> FloatArray:
    out = np.zeros((X.shape[0], n_classes))
    out[:, model.classes_] = model.predict_proba(X)
    return out


def _relabel(data: Dataset, rows: IntArray, labels: IntArray) -> Dataset:
    y = data.y.copy()
    y[rows] = labels
    return Dataset(data.X, y, data.name, data.n_classes, data.image_shape)


def _runner_up(proba: FloatArray, truth: IntArray) -> IntArray:
    masked = proba.copy()
    masked[np.arange(truth.size), truth] = -np.inf
    return np.asarray(masked.argmax(axis=1), dtype=np.int64)


@dataclass(frozen=True)
class RandomFlip(_FractionPoisoner):
    """Flip a fraction of the training labels to uniformly drawn other classes.

    Parameters
    ----------
    fraction : float
        Fraction of training points flipped, in (0, 1].
    """

    name: ClassVar[str] = "rps-random-flip"
    requires: ClassVar[frozenset[Capability]] = TRAIN
    fraction: float = 0.05

    def poison(self, task: ConformalTask, rng: np.random.Generator) -> ConformalTask:
        """Return the task with flipped training labels."""
        train = task.train
        n = _count(self.fraction, len(train))
        rows = np.sort(rng.choice(len(train), size=n, replace=False))
        shift = rng.integers(1, train.n_classes, size=n)
        labels = (train.y[rows] + shift) % train.n_classes
        return task.poisoned(train=_relabel(train, rows, labels))


@dataclass(frozen=True)
class PairFlip:
    """Relabel a fraction of class ``source`` as class ``target``.

    Parameters
    ----------
    source, target : int
        Classes (distinct, checked against the data at poisoning time).
    fraction : float
        Fraction of the source class flipped, in (0, 1].
    """

    name: ClassVar[str] = "rps-pair-flip"
    requires: ClassVar[frozenset[Capability]] = TRAIN
    source: int = 0
    target: int = 1
    fraction: float = 0.5

    def __post_init__(self) -> None:
        check_int("PairFlip.source", self.source, 0)
        check_int("PairFlip.target", self.target, 0)
        if self.source == self.target:
            raise ValueError(
                f"PairFlip.source and target must differ, got {self.source}"
            )
        _fraction("PairFlip", self.fraction)

    def poison(self, task: ConformalTask, rng: np.random.Generator) -> ConformalTask:
        """Return the task with ``source`` labels flipped to ``target``."""
        train = task.train
        if max(self.source, self.target) >= train.n_classes:
            raise ValueError(
                f"PairFlip classes ({self.source}, {self.target}) must lie in "
                f"[0, {train.n_classes})"
            )
        members = np.flatnonzero(train.y == self.source)
        n = _count(self.fraction, members.size)
        rows = np.sort(rng.choice(members, size=n, replace=False))
        labels = np.full(n, self.target, dtype=np.int64)
        return task.poisoned(train=_relabel(train, rows, labels))


@dataclass(frozen=True)
class TargetedFlip:
    """Relabel each target's nearest training neighbours to its runner-up class.

    Parameters
    ----------
    flips : int
        Neighbours relabelled per target (those already labelled as the runner-up
        are skipped, and so is a neighbour whose class it would erase from the
        training set: with few classes, e.g. 5 targets x 20 flips on breast
        cancer's ~95 malignant training points, every point of a class could
        otherwise be relabelled, and no learner is defined on one class).
    """

    name: ClassVar[str] = "rps-targeted-flip"
    requires: ClassVar[frozenset[Capability]] = TRAIN
    flips: int = 5

    def __post_init__(self) -> None:
        check_int("TargetedFlip.flips", self.flips, 1)

    def poison(self, task: ConformalTask, rng: np.random.Generator) -> ConformalTask:
        """Return the task with the targets' neighbourhoods relabelled."""
        train = task.train
        targets = task.test.X[task.targets]
        truth = task.test.y[task.targets]
        runner = _runner_up(_proba(surrogate(train), targets, train.n_classes), truth)
        y = train.y.copy()
        counts = np.bincount(y, minlength=train.n_classes)
        for x, label in zip(targets, runner, strict=True):
            distance = np.linalg.norm(train.X - x, axis=1)
            candidates = np.argsort(distance, kind="stable")
            flipped = 0
            for row in candidates[y[candidates] != label]:
                if flipped == self.flips:
                    break
                if counts[y[row]] > 1:
                    counts[y[row]] -= 1
                    counts[label] += 1
                    y[row] = label
                    flipped += 1
        return task.poisoned(train=Dataset(train.X, y, train.name, train.n_classes))


def _ranked_calibration(
    task: ConformalTask, fraction: float
) -> tuple[FloatArray, IntArray, int]:
    """Surrogate probabilities, calibration points by own-label score, and a count.

    The points are ordered lowest score first (stable sort); the count is the
    ``fraction`` of them to poison.
    """
    calib = task.calib
    proba = _proba(surrogate(task.train), calib.X, calib.n_classes)
    own = proba[np.arange(len(calib)), calib.y]
    return proba, np.argsort(own, kind="stable"), _count(fraction, len(calib))


@dataclass(frozen=True)
class CalibrationCoverage(_FractionPoisoner):
    """Replace the lowest-score calibration points by copies of the highest ones.

    Each replacement is a deletion plus an insertion (two poisoned points); copies
    are nudged so that they are distinct points.

    Parameters
    ----------
    fraction : float
        Fraction of the calibration set replaced, in (0, 1].
    """

    name: ClassVar[str] = "rps-calib-coverage"
    requires: ClassVar[frozenset[Capability]] = CALIB
    fraction: float = 0.1

    def poison(self, task: ConformalTask, rng: np.random.Generator) -> ConformalTask:
        """Return the task with replaced calibration points."""
        calib = task.calib
        _, order, n = _ranked_calibration(task, self.fraction)
        low, high = order[:n], order[::-1][:n]
        X = calib.X.copy()
        y = calib.y.copy()
        X[low] = calib.X[high] + 1e-7 * np.arange(1, n + 1)[:, None]
        y[low] = calib.y[high]
        return task.poisoned(calib=Dataset(X, y, calib.name, calib.n_classes))


@dataclass(frozen=True)
class CalibrationSize(_FractionPoisoner):
    """Relabel the highest-score calibration points to their least likely class.

    Parameters
    ----------
    fraction : float
        Fraction of the calibration set relabelled, in (0, 1].
    """

    name: ClassVar[str] = "rps-calib-size"
    requires: ClassVar[frozenset[Capability]] = CALIB
    fraction: float = 0.1

    def poison(self, task: ConformalTask, rng: np.random.Generator) -> ConformalTask:
        """Return the task with relabelled calibration points."""
        proba, order, n = _ranked_calibration(task, self.fraction)
        rows = np.sort(order[::-1][:n])
        labels = np.asarray(proba[rows].argmin(axis=1), dtype=np.int64)
        return task.poisoned(calib=_relabel(task.calib, rows, labels))


def nudge_into_part(
    x: FloatArray, part: int, n_parts: int, start: int = 1
) -> FloatArray:
    """A copy of ``x`` moved by multiples of 1e-7 in feature 0 into hash ``part``."""
    for step in range(start, start + 1000 * n_parts):
        candidate = x.copy()
        candidate[0] += 1e-7 * step
        if part_of(candidate[None, :], n_parts)[0] == part:
            return candidate
    raise RuntimeError(f"no nudge of x lands in part {part} of {n_parts}")


@dataclass(frozen=True)
class WorstCase:
    """Take over whole hash parts around each target (the certificate's adversary).

    Parameters
    ----------
    n_train_parts, n_calib_parts : int
        The defender's ``k_t`` and ``k_c`` (the attacker knows the algorithm).
    train_parts : int
        Training parts flooded per target (0: none).
    calib_parts : int
        Calibration parts flooded in total (0: none).
    copies : int
        Points inserted per flooded part.
    """

    name: ClassVar[str] = "rps-worst-case"
    requires: ClassVar[frozenset[Capability]] = TRAIN | CALIB
    n_train_parts: int = 20
    n_calib_parts: int = 10
    train_parts: int = 1
    calib_parts: int = 0
    copies: int = 10

    def __post_init__(self) -> None:
        check_int("WorstCase.n_train_parts", self.n_train_parts, 1)
        check_int("WorstCase.n_calib_parts", self.n_calib_parts, 1)
        check_int("WorstCase.train_parts", self.train_parts, 0)
        check_int("WorstCase.calib_parts", self.calib_parts, 0)
        check_int("WorstCase.copies", self.copies, 1)
        if (
            self.train_parts > self.n_train_parts
            or self.calib_parts > self.n_calib_parts
        ):
            raise ValueError(
                "WorstCase cannot take over more parts than there are: "
                f"train_parts={self.train_parts} of {self.n_train_parts}, "
                f"calib_parts={self.calib_parts} of {self.n_calib_parts}"
            )

    def _replica(self, task: ConformalTask) -> ReliableConformalClassifier:
        """The attacker's copy of the defender's part models (memoised)."""
        key = (self.n_train_parts, checksum(task.train))
        if key not in _REPLICAS:
            if len(_REPLICAS) >= 8:
                _REPLICAS.pop(next(iter(_REPLICAS)))
            replica = ReliableConformalClassifier(
                LogisticRegression(max_iter=1000),
                n_train_parts=self.n_train_parts,
                n_calib_parts=1,
            )
            _REPLICAS[key] = replica.fit(task.train.X, task.train.y)
        return _REPLICAS[key]

    def poison(self, task: ConformalTask, rng: np.random.Generator) -> ConformalTask:
        """Return the task with flooded training and calibration parts."""
        train, calib = task.train, task.calib
        targets = task.test.X[task.targets]
        truth = task.test.y[task.targets]
        replica = self._replica(task)
        votes = np.stack([m.predict(targets) for m in replica.estimators_])
        scores = replica.predict_scores(targets)
        runner = _runner_up(scores, truth)
        new_X, new_y = [train.X], [train.y]
        for t, (x, label) in enumerate(zip(targets, runner, strict=True)):
            voting = np.flatnonzero(votes[:, t] == truth[t])
            others = rng.permutation(np.flatnonzero(votes[:, t] != truth[t]))
            chosen = np.concatenate([rng.permutation(voting), others])[
                : self.train_parts
            ]
            for part in chosen:
                copies = [
                    nudge_into_part(
                        x, int(part), self.n_train_parts, start=1 + 2000 * c
                    )
                    for c in range(self.copies)
                ]
                new_X.append(np.stack(copies))
                new_y.append(np.full(self.copies, label, dtype=np.int64))
        poisoned_train = Dataset(
            np.concatenate(new_X), np.concatenate(new_y), train.name, train.n_classes
        )
        poisoned_calib = calib
        if self.calib_parts:
            own = replica.predict_scores(calib.X)[np.arange(len(calib)), calib.y]
            best = int(np.argmax(own))
            parts = rng.choice(self.n_calib_parts, size=self.calib_parts, replace=False)
            cal_X, cal_y = [calib.X], [calib.y]
            for part in parts:
                copies = [
                    nudge_into_part(
                        calib.X[best], int(part), self.n_calib_parts, 1 + 2000 * c
                    )
                    for c in range(self.copies)
                ]
                cal_X.append(np.stack(copies))
                cal_y.append(np.full(self.copies, calib.y[best], dtype=np.int64))
            poisoned_calib = Dataset(
                np.concatenate(cal_X),
                np.concatenate(cal_y),
                calib.name,
                calib.n_classes,
            )
        return task.poisoned(train=poisoned_train, calib=poisoned_calib)


ATTACKS = (
    RandomFlip,
    PairFlip,
    TargetedFlip,
    CalibrationCoverage,
    CalibrationSize,
    WorstCase,
)
"""The package's attacks (registered by :mod:`defenses.rps.scenario`)."""
