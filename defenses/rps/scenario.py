"""Harness wiring: conformal prediction under training and calibration poisoning.

The game (after Scholten & Günnemann, ICLR 2025): a data set is split (stratified)
into training, calibration and test parts and ``n_targets`` test points are drawn
as targets. The attacker rewrites the training and/or calibration data; the system
is fitted and conformalized on the poisoned task. Utility is the test coverage and set
size; the judge refits the same learner on the clean task and scores how much the
sets moved (higher = stronger attack), and counts certified (point, class)
memberships that changed anyway (``violations``: a sound certificate keeps it 0).

Importing this module registers the package's scenario, attacks, defenses,
measurement benchmarks and figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from defenses.checks import check_fraction, check_int, check_real
from defenses.data import LOADERS, load, stratified_split
from defenses.metrics import coverage, mean_set_size
from defenses.registry import register, register_package
from defenses.rps import benchmark, figures
from defenses.rps.arms import (
    RPS,
    BaggingEnsemble,
    ConformalSystem,
    SplitConformalLearner,
)
from defenses.rps.attacks import ATTACKS
from defenses.rps.tasks import ConformalTask
from defenses.threat import POISONING, ThreatModel

register_package(
    attacks=ATTACKS,
    defenses=[RPS, BaggingEnsemble],
    benchmarks={
        "rps-coverage": benchmark.coverage_study,
        "rps-tradeoff": benchmark.tradeoff,
        "rps-perf": benchmark.performance,
    },
    figures={"rps": figures.figures},
)


@register("scenarios", "rps-poisoning")
@dataclass(frozen=True)
class ConformalPoisoning:
    """Poison the training / calibration data of a conformal classifier.

    Parameters
    ----------
    dataset : str
        A bundled data set (``digits``, ``breast_cancer``, ``wine``).
    confidence_level : float
        Target coverage of the conformal sets.
    train_fraction, calib_fraction : float
        Shares of the data for training and calibration (the rest is test).
    n_targets : int
        Test points a targeted attacker aims at.
    subsample : float
        Share of the data set used at all (1: all of it), to make tiny games.
    """

    name: ClassVar[str] = "rps-poisoning"
    headline: ClassVar[tuple[str, str]] = ("coverage", "target_changed_rate")
    chance: ClassVar[Mapping[str, float]] = {
        "target_changed_rate": 0.0,
        "changed_rate": 0.0,
    }
    dataset: str = "digits"
    confidence_level: float = 0.9
    train_fraction: float = 0.45
    calib_fraction: float = 0.33
    n_targets: int = 10
    subsample: float = 1.0

    def __post_init__(self) -> None:
        if self.dataset not in LOADERS:
            raise ValueError(
                f"ConformalPoisoning.dataset must be one of {sorted(LOADERS)}, "
                f"got {self.dataset!r}"
            )
        for field in ("confidence_level", "train_fraction", "calib_fraction"):
            check_fraction(f"ConformalPoisoning.{field}", getattr(self, field))
        if self.train_fraction + self.calib_fraction >= 1:
            raise ValueError(
                "ConformalPoisoning.train_fraction + calib_fraction must be < 1 "
                f"(a test split is needed), got {self.train_fraction} + "
                f"{self.calib_fraction}"
            )
        check_int("ConformalPoisoning.n_targets", self.n_targets, 1)
        check_real(
            "ConformalPoisoning.subsample", self.subsample, 0.0, 1.0, open_low=True
        )

    @property
    def threat(self) -> ThreatModel:
        """A gray-box poisoner of the training and calibration data."""
        return ThreatModel.granting("integrity", *POISONING, knowledge="gray-box")

    def setup(self, rng: np.random.Generator) -> ConformalTask:
        """Split the data (stratified) and draw the targets."""
        data = load(self.dataset)
        if self.subsample < 1:
            keep, _ = stratified_split(
                data.y, [self.subsample, 1 - self.subsample], rng
            )
            data = data.subset(keep)
        test_fraction = 1 - self.train_fraction - self.calib_fraction
        tr, ca, te = stratified_split(
            data.y, [self.train_fraction, self.calib_fraction, test_fraction], rng
        )
        test = data.subset(te)
        if self.n_targets > len(test):
            raise ValueError(
                f"n_targets={self.n_targets} exceeds the test split ({len(test)})"
            )
        targets = np.sort(rng.choice(len(test), size=self.n_targets, replace=False))
        return ConformalTask(
            data.subset(tr), data.subset(ca), test, targets.astype(np.int64)
        )

    def learner(self) -> SplitConformalLearner:
        """Plain split conformal prediction around a logistic regression."""
        return SplitConformalLearner(confidence_level=self.confidence_level)

    def utility(self, system: ConformalSystem, task: ConformalTask) -> dict[str, float]:
        """Test coverage, mean set size, and the share of empty / singleton sets."""
        sets = system.sets(task.test.X)
        size = sets.sum(axis=1)
        return {
            "coverage": coverage(sets, task.test.y),
            "set_size": mean_set_size(sets),
            "empty_rate": float(np.mean(size == 0)),
            "singleton_rate": float(np.mean(size == 1)),
        }

    def expose(
        self, system: ConformalSystem, task: ConformalTask, known_defense: object | None
    ) -> None:
        """Training-stage game: the attacker sees no deployed system."""
        return None

    def judge(
        self, system: ConformalSystem, task: ConformalTask, guess: object | None
    ) -> dict[str, float]:
        """How far the sets moved from the clean refit; certificate violations."""
        test = task.test
        poisoned = system.sets(test.X)
        clean_system = system if task.clean is None else system.refit(task.clean)
        clean = clean_system.sets(test.X)
        changed = np.any(poisoned != clean, axis=1)
        rows = np.arange(len(test))
        r_t, r_c = system.radii(task)
        certified = clean_system.certified(test.X, r_t, r_c)
        return {
            "target_changed_rate": float(np.mean(changed[task.targets])),
            "target_miss_rate": float(
                np.mean(~poisoned[task.targets, test.y[task.targets]])
            ),
            "changed_rate": float(np.mean(changed)),
            "miscoverage_gain": float(
                np.mean(clean[rows, test.y]) - np.mean(poisoned[rows, test.y])
            ),
            "size_gain": float(poisoned.sum(axis=1).mean() - clean.sum(axis=1).mean()),
            "violations": float(np.sum(certified & (poisoned != clean))),
            "radius_train": float(r_t),
            "radius_calib": float(r_c),
        }

    def random_guess(self, task: ConformalTask, rng: np.random.Generator) -> None:
        """No blind guess at the training stage."""
        return None
