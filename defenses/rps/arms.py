"""Harness arms: the undefended split-conformal learner, RPS and the bagged ensemble.

The undefended system is plain split conformal prediction around a logistic
regression (:class:`SplitConformalLearner`); :class:`RPS` and
:class:`BaggingEnsemble` wrap it (same base estimator and confidence level) into
:class:`~defenses.rps.defense.ReliableConformalClassifier` and
:class:`~defenses.rps.baselines.EnsembleConformalClassifier`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt
from sklearn.linear_model import LogisticRegression

from defenses.api import DefenseKind
from defenses.arrays import BoolArray
from defenses.checks import check_choice, check_fraction, check_int, check_real
from defenses.rps.baselines import EnsembleConformalClassifier, SplitConformalClassifier
from defenses.rps.defense import ReliableConformalClassifier
from defenses.rps.quantile import QUANTILE_MODES, QuantileMode
from defenses.rps.tasks import ConformalTask, changed_rows, checksum, touched_parts

_REFITS: OrderedDict[tuple[Any, int, int], ConformalSystem] = OrderedDict()
_REFIT_CACHE_SIZE = 16


class SetPredictor(Protocol):
    """A conformalized predictor in MAPIE 1.x's vocabulary."""

    def predict_set(self, X: Any) -> tuple[npt.NDArray[Any], BoolArray]:
        """Point predictions and boolean (n, K, 1) sets."""
        ...


class ConformalLearner(Protocol):
    """Learners of this package: fit a task into a :class:`ConformalSystem`."""

    def fit(self, task: ConformalTask, rng: np.random.Generator) -> ConformalSystem:
        """Train and conformalize on ``task``."""
        ...


@dataclass(frozen=True)
class ConformalSystem:
    """A fitted, conformalized predictor and the learner that made it."""

    model: SetPredictor
    learner: ConformalLearner

    def sets(self, X: Any) -> BoolArray:
        """Prediction sets of ``X``, boolean (n, K)."""
        return self.model.predict_set(X)[1][:, :, 0]

    def refit(self, task: ConformalTask) -> ConformalSystem:
        """The same learner fitted on another task (learners are deterministic).

        Refits are memoised by (learner, training and calibration checksums): the
        judge refits the same clean task for every attack of a seed.
        """
        key = (self.learner, checksum(task.train), checksum(task.calib))
        system = _REFITS.get(key)
        if system is None:
            system = self.learner.fit(task, np.random.default_rng(0))
            _REFITS[key] = system
            if len(_REFITS) > _REFIT_CACHE_SIZE:
                _REFITS.popitem(last=False)
        return system

    def radii(self, task: ConformalTask) -> tuple[int, int]:
        """(r_t, r_c) separating ``task`` from its clean task, in this system's units.

        For RPS: the number of training / calibration hash parts holding a changed
        point. Otherwise: the number of changed points.
        """
        if task.clean is None:
            return 0, 0
        if isinstance(self.model, ReliableConformalClassifier):
            return (
                touched_parts(task.clean.train, task.train, self.model.n_train_parts),
                touched_parts(task.clean.calib, task.calib, self.model.n_calib_parts),
            )
        return (
            changed_rows(task.clean.train, task.train)[0],
            changed_rows(task.clean.calib, task.calib)[0],
        )

    def certified(self, X: Any, train_radius: int, calib_radius: int) -> BoolArray:
        """(point, class) memberships certified at (r_t, r_c); none for baselines."""
        if isinstance(self.model, ReliableConformalClassifier):
            return self.model.certify(X).certified(train_radius, calib_radius)
        sets = self.sets(X)
        return np.full(sets.shape, train_radius == 0 and calib_radius == 0)


def logistic_regression(C: float) -> LogisticRegression:
    """The base estimator of the game."""
    return LogisticRegression(C=C, max_iter=1000)


@dataclass(frozen=True)
class SplitConformalLearner:
    """Plain split conformal prediction around a logistic regression.

    Parameters
    ----------
    confidence_level : float
        Target coverage in (0, 1).
    C : float
        Inverse regularisation of the logistic regression.
    """

    confidence_level: float = 0.9
    C: float = 1.0

    def __post_init__(self) -> None:
        check_fraction("SplitConformalLearner.confidence_level", self.confidence_level)
        check_real("SplitConformalLearner.C", self.C, 0.0, open_low=True)

    def fit(self, task: ConformalTask, rng: np.random.Generator) -> ConformalSystem:
        """Fit on ``task.train``, conformalize on ``task.calib``."""
        model = SplitConformalClassifier(
            logistic_regression(self.C), self.confidence_level
        )
        model.fit(task.train.X, task.train.y).conformalize(task.calib.X, task.calib.y)
        return ConformalSystem(model, self)


@dataclass(frozen=True)
class RPSLearner:
    """The RPS-defended learner (built by :meth:`RPS.wrap`)."""

    base: SplitConformalLearner
    defense: RPS

    def fit(self, task: ConformalTask, rng: np.random.Generator) -> ConformalSystem:
        """Fit the partitioned ensemble and conformalize the majority sets."""
        d = self.defense
        model = ReliableConformalClassifier(
            logistic_regression(self.base.C),
            n_train_parts=d.n_train_parts,
            n_calib_parts=d.n_calib_parts,
            confidence_level=self.base.confidence_level,
            quantile=d.mode,
            softmax=d.softmax,
        )
        model.fit(task.train.X, task.train.y).conformalize(task.calib.X, task.calib.y)
        return ConformalSystem(model, self)


def _check_learner(learner: Any, who: str) -> SplitConformalLearner:
    if not isinstance(learner, SplitConformalLearner):
        raise TypeError(
            f"{who} wraps a SplitConformalLearner, got {type(learner).__name__}"
        )
    return learner


@dataclass(frozen=True)
class RPS:
    """Reliable prediction sets (Scholten & Günnemann, ICLR 2025) as a defense.

    Parameters
    ----------
    n_train_parts : int
        ``k_t``, hash parts of the training data.
    n_calib_parts : int
        ``k_c``, hash parts of the calibration data.
    quantile : {"exact", "official", "markov"}
        Per-part rank rule.
    softmax : bool
        Softmax-smoothed vote score.
    """

    name: ClassVar[str] = "rps-reliable"
    kind: ClassVar[DefenseKind] = DefenseKind.TRAINER
    n_train_parts: int = 20
    n_calib_parts: int = 10
    quantile: str = "exact"
    softmax: bool = True

    def __post_init__(self) -> None:
        check_int("RPS.n_train_parts", self.n_train_parts, 1)
        check_int("RPS.n_calib_parts", self.n_calib_parts, 1)
        check_choice("RPS.quantile", self.quantile, QUANTILE_MODES)
        if not isinstance(self.softmax, bool):
            raise ValueError(f"RPS.softmax must be a bool, got {self.softmax!r}")

    @property
    def mode(self) -> QuantileMode:
        """The rank rule, typed."""
        mode: QuantileMode = self.quantile  # type: ignore[assignment]
        return mode

    def wrap(self, learner: Any) -> RPSLearner:
        """The RPS learner with the wrapped learner's estimator and confidence level."""
        return RPSLearner(_check_learner(learner, "RPS"), self)

    def certify(self, system: ConformalSystem, task: ConformalTask) -> dict[str, float]:
        """Fractions of test points certified robust / coverage-reliable.

        ``certified_coverage_fraction@rt2``: test points whose true label is in the
        set and certified to stay there under 2 poisoned training points (a lower
        bound on the coverage the attacker cannot destroy).
        """
        model = system.model
        if not isinstance(model, ReliableConformalClassifier):
            raise TypeError("RPS.certify needs a system fitted by RPS")
        cert = model.certify(task.test.X)
        out: dict[str, float] = {
            "miscoverage_bound": float(model.miscoverage_bound_),
            "certified_target_fraction": float(
                np.mean(cert.robust(*system.radii(task))[task.targets])
            ),
        }
        for r in (1, 2, 4, 8):
            out[f"robust_fraction@rt{r}"] = float(np.mean(cert.robust(r, 0)))
            out[f"coverage_reliable_fraction@rt{r}"] = float(
                np.mean(cert.coverage_reliable(r, 0))
            )
        for r in (1, 2, 4):
            out[f"robust_fraction@rc{r}"] = float(np.mean(cert.robust(0, r)))
            out[f"robust_fraction@rt{r}rc{r}"] = float(np.mean(cert.robust(r, r)))
        rows = np.arange(len(task.test))
        true_in = cert.sets[rows, task.test.y]
        out["certified_coverage_fraction@rt2"] = float(
            np.mean(true_in & cert.certified(2, 0)[rows, task.test.y])
        )
        return out


@dataclass(frozen=True)
class EnsembleLearner:
    """The bagged-ensemble learner (built by :meth:`BaggingEnsemble.wrap`)."""

    base: SplitConformalLearner
    defense: BaggingEnsemble

    def fit(self, task: ConformalTask, rng: np.random.Generator) -> ConformalSystem:
        """Fit the bagged ensemble and conformalize one threshold."""
        model = EnsembleConformalClassifier(
            logistic_regression(self.base.C),
            self.defense.n_models,
            self.base.confidence_level,
        )
        model.fit(task.train.X, task.train.y).conformalize(task.calib.X, task.calib.y)
        return ConformalSystem(model, self)


@dataclass(frozen=True)
class BaggingEnsemble:
    """A plain voting ensemble without partitioning (baseline, no certificate).

    Parameters
    ----------
    n_models : int
        Number of bootstrap models.
    """

    name: ClassVar[str] = "rps-bagging"
    kind: ClassVar[DefenseKind] = DefenseKind.TRAINER
    n_models: int = 20

    def __post_init__(self) -> None:
        check_int("BaggingEnsemble.n_models", self.n_models, 1)

    def wrap(self, learner: Any) -> EnsembleLearner:
        """The bagged learner with the wrapped learner's estimator and confidence."""
        return EnsembleLearner(_check_learner(learner, "BaggingEnsemble"), self)
