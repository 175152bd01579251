"""Harness wiring of SSD: the black-box model-inversion game.

The challenger trains a target MLP on private classes and deploys it behind a query
oracle (scores and labels). The adversary holds unlabelled public data of other
classes and must produce, for each target class, inputs the judge's independent
evaluation model assigns to that class. Success metrics (higher = stronger attack):

* ``acc@1`` / ``acc@k``: top-1 / top-k accuracy of the evaluation model on the
  reconstructions (k = 2 at K = 5, 5 at K = 50);
* ``verified_rate``: reconstructions whose nearest neighbour, in the evaluation
  model's features, among private training and public images is a private image of
  the target class (an open-set check that the reconstruction resembles the secret);
* ``feature_dist``: mean distance, in those features, to the nearest private
  training image of the target class (the paper's KNN distance; the one success
  metric where *lower* means a stronger attack).

Utility: test ``accuracy`` of the deployed answers, ``l1_distortion`` (mean L1
distance to the undefended answers, the paper's Dist), and the arg-max flip rates on
test inputs and on public (attack-like, off-manifold) inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from scipy.spatial.distance import cdist

from defenses import serving_benchmark  # noqa: F401  (registers serve-load and its figure)
from defenses.arrays import FloatArray
from defenses.checks import check_int
from defenses.metrics import accuracy
from defenses.oracle import QueryOracle
from defenses.registry import register, register_package
from defenses.ssd import benchmark, figures  # noqa: F401  (they register themselves)
from defenses.ssd.arms import Deployed, SSDDefense
from defenses.ssd.attacks import ATTACKS, InversionView
from defenses.ssd.baselines import BASELINES
from defenses.ssd.tasks import InversionTask, build_task, predict_proba, train_mlp
from defenses.threads import single_thread
from defenses.threat import QUERYING, Budget, Capability, ThreatModel

register_package(attacks=ATTACKS, defenses=[SSDDefense, *BASELINES])

TARGET_HIDDEN = (128,)


@dataclass(frozen=True, eq=False)
class TargetModel:
    """The deployed, undefended target: a one-hidden-layer ReLU MLP."""

    net: torch.nn.Sequential

    def predict_proba(self, X: FloatArray) -> FloatArray:
        """Softmax probabilities."""
        return predict_proba(self.net, X)

    def clean_proba(self, X: FloatArray) -> FloatArray:
        """Same as :meth:`predict_proba` (nothing to undo)."""
        return predict_proba(self.net, X)


@functools.lru_cache(maxsize=8)
def _train_target(task: InversionTask, key: int, epochs: int) -> TargetModel:
    net = train_mlp(
        task.train.X,
        task.train.y,
        task.n_classes,
        TARGET_HIDDEN,
        np.random.default_rng(key),
        epochs=epochs,
        lr=1e-2,
    )
    return TargetModel(net)


@dataclass(frozen=True)
class TargetLearner:
    """Train the target MLP (cached per task and seed: every arm shares it).

    Parameters
    ----------
    epochs : int
        Full-batch Adam epochs.
    """

    epochs: int = 150

    def fit(self, task: InversionTask, rng: np.random.Generator) -> TargetModel:
        """Train on the private training split."""
        return _train_target(task, int(rng.integers(2**62)), self.epochs)


def uniform_guess(top_k: int, classes: int) -> dict[str, float]:
    """``acc@1`` and ``acc@k`` of a uniform guess among ``classes``: 1/K and k/K."""
    return {"acc@1": 1 / classes, f"acc@{top_k}": top_k / classes}


@dataclass(frozen=True)
class _InversionGame:
    """The shared game; subclasses fix the data world and its private classes.

    Parameters
    ----------
    n_targets : int
        Target classes (the first private ones), in [1, ``private_classes``].
    per_target : int
        Reconstructions per target class.
    queries : int or None
        Query budget of the adversary; None means unlimited.
    """

    name: ClassVar[str]
    world: ClassVar[str]
    top_k: ClassVar[int]
    private_classes: ClassVar[int]
    headline: ClassVar[tuple[str, str]] = ("accuracy", "acc@1")
    chance: ClassVar[Mapping[str, float]]
    n_targets: int
    per_target: int = 5
    queries: int | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int(f"{owner}.n_targets", self.n_targets, 1, self.private_classes)
        check_int(f"{owner}.per_target", self.per_target, minimum=1)
        if self.queries is not None:
            check_int(f"{owner}.queries", self.queries, minimum=1)

    @property
    def threat(self) -> ThreatModel:
        """Black-box scores and labels; the adversary knows the defense (adaptive)."""
        return ThreatModel.granting(
            "confidentiality",
            *QUERYING,
            Capability.AUX_DATA,
            budget=Budget(queries=self.queries),
            adaptive=True,
        )

    def setup(self, rng: np.random.Generator) -> InversionTask:
        """Split the private data, draw the public data, train the judge's model."""
        return build_task(
            self.world, int(rng.integers(2**62)), self.n_targets, self.per_target
        )

    def learner(self) -> TargetLearner:
        """The undefended target learner."""
        return TargetLearner()

    def utility(self, system: Deployed, task: InversionTask) -> dict[str, float]:
        """Test accuracy, L1 distortion and arg-max flip rates (test and public)."""
        answers = system.predict_proba(task.test.X)
        clean = system.clean_proba(task.test.X)
        public_answers = system.predict_proba(task.public)
        public_clean = system.clean_proba(task.public)
        return {
            "accuracy": accuracy(np.argmax(answers, axis=1), task.test.y),
            "l1_distortion": float(np.abs(answers - clean).sum(axis=1).mean()),
            "test_flip_rate": float(
                np.mean(np.argmax(answers, axis=1) != np.argmax(clean, axis=1))
            ),
            "public_flip_rate": float(
                np.mean(
                    np.argmax(public_answers, axis=1) != np.argmax(public_clean, axis=1)
                )
            ),
        }

    def expose(
        self, system: Deployed, task: InversionTask, known_defense: object | None
    ) -> InversionView:
        """An oracle on the deployed answers, the public data and the targets."""
        oracle = QueryOracle.granted_by(system.predict_proba, self.threat)
        return InversionView(
            oracle, task.public, task.targets, task.bounds, known_defense
        )

    def judge(
        self, system: Deployed, task: InversionTask, guess: FloatArray | None
    ) -> dict[str, float]:
        """Evaluation-model accuracy, verified rate and feature distance."""
        if guess is None:
            raise ValueError("the inversion game needs reconstructions")
        recon = np.asarray(guess, dtype=np.float64)
        expected = (task.targets.size, task.train.X.shape[1])
        if recon.shape != expected or not np.all(np.isfinite(recon)):
            raise ValueError(
                f"reconstructions must be finite with shape {expected}, "
                f"got {recon.shape}"
            )
        evaluator = task.evaluator
        probs = evaluator.predict_proba(recon)
        ranks = np.argsort(-probs, axis=1, kind="stable")
        hit = ranks == task.targets[:, None]
        feats = evaluator.features(recon)
        with single_thread():
            dists = cdist(feats, evaluator.reference)
        nearest = evaluator.reference_labels[np.argmin(dists, axis=1)]
        same = evaluator.reference_labels[None, :] == task.targets[:, None]
        return {
            "acc@1": float(hit[:, 0].mean()),
            f"acc@{self.top_k}": float(hit[:, : self.top_k].any(axis=1).mean()),
            "verified_rate": float(np.mean(nearest == task.targets)),
            "feature_dist": float(np.where(same, dists, np.inf).min(axis=1).mean()),
        }

    def random_guess(self, task: InversionTask, rng: np.random.Generator) -> FloatArray:
        """Random public images, one per reconstruction (blind to the target)."""
        pick = rng.integers(task.public.shape[0], size=task.targets.size)
        return task.public[pick]


@register("scenarios", "ssd-digits")
@dataclass(frozen=True)
class DigitsInversion(_InversionGame):
    """Model inversion of digits 0-4 (private) with digits 5-9 as public data.

    Parameters as in :class:`_InversionGame`; ``n_targets`` in [1, 5], default 5.
    """

    name: ClassVar[str] = "ssd-digits"
    world: ClassVar[str] = "digits"
    top_k: ClassVar[int] = 2
    private_classes: ClassVar[int] = 5
    chance: ClassVar[Mapping[str, float]] = uniform_guess(2, 5)
    n_targets: int = 5


@register("scenarios", "ssd-identities")
@dataclass(frozen=True)
class IdentitiesInversion(_InversionGame):
    """Model inversion of 50 synthetic identities with 100 public ones.

    Parameters as in :class:`_InversionGame`; ``n_targets`` in [1, 50], default 10,
    and ``per_target`` defaults to 3.
    """

    name: ClassVar[str] = "ssd-identities"
    world: ClassVar[str] = "identities"
    top_k: ClassVar[int] = 5
    private_classes: ClassVar[int] = 50
    chance: ClassVar[Mapping[str, float]] = uniform_guess(5, 50)
    n_targets: int = 10
    per_target: int = 3
