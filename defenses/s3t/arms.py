"""Harness arms: the undefended learner and the unlearning defenses that wrap it.

The undefended service fine-tunes one LoRA model on all the data and, asked to
delete, only drops the rows from its database (the model keeps what it learned). The
defenses replace its training with an exact-unlearning learner, serve the deletion
requests of the task, and retrain when their policy says so:

* ``s3t-s3t``: S3T, retraining only once every shard is dead;
* ``s3t-sisa``: SISA, retraining the hit shards from their checkpoint at every
  deletion (Bourtoule et al., 2021);
* ``s3t-full-retrain``: retraining from scratch at every deletion.

All three certify exactness by a lineage audit of the served system.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import numpy as np
import numpy.typing as npt
from torch import nn

from defenses.api import DefenseKind, Learner
from defenses.arrays import FloatArray
from defenses.checks import check_choice, check_int
from defenses.fields import values_of
from defenses.s3t.attacks import lineage_audit
from defenses.s3t.baselines import SISA, FullRetrain
from defenses.s3t.defense import S3T, Selection, Unlearner

Policy = Literal["always", "when_dead"]
POLICIES: tuple[Policy, ...] = ("always", "when_dead")


class UnlearningTask(Protocol):
    """What the learners need from a task."""

    @property
    def backbone(self) -> nn.Module:
        """The frozen pretrained model."""
        ...

    @property
    def targets(self) -> list[str] | None:
        """The layers that get adapters (None: the ResidualMLP's default)."""
        ...

    @property
    def head(self) -> str | None:
        """The module every stage trains in full (None: the default)."""
        ...

    @property
    def X(self) -> FloatArray:
        """Training features (pool and planted canaries)."""
        ...

    @property
    def y(self) -> npt.NDArray[np.int64]:
        """Training labels."""
        ...

    @property
    def ids(self) -> npt.NDArray[np.int64]:
        """Sample ids."""
        ...

    @property
    def groups(self) -> npt.NDArray[np.int64]:
        """Partition keys (one per user)."""
        ...

    @property
    def forget(self) -> npt.NDArray[np.int64]:
        """Ids whose deletion is requested after training."""
        ...


@dataclass(frozen=True)
class NoUnlearning:
    """Undefended: one LoRA model on all the data; deletions only drop the rows.

    Parameters
    ----------
    rank, epochs, batch_size : int
        LoRA rank and Adam settings (shared with the defenses that wrap it).
    lr : float
        Adam learning rate.
    """

    rank: int = 4
    epochs: int = 10
    batch_size: int = 64
    lr: float = 3e-3

    def fit(self, task: UnlearningTask, rng: np.random.Generator) -> FullRetrain:
        """Train on everything, ignore the deletion requests."""
        model = FullRetrain(
            task.backbone,
            self.rank,
            target_modules=task.targets,
            head=task.head,
            epochs=self.epochs,
            batch_size=self.batch_size,
            lr=self.lr,
            seed=int(rng.integers(2**31)),
        )
        model.fit(task.X, task.y, task.ids, task.groups)
        return model


def _base(learner: Learner[Any, Any], who: str) -> NoUnlearning:
    if not isinstance(learner, NoUnlearning):
        raise TypeError(
            f"{who} wraps the s3t scenario's NoUnlearning learner, got {learner!r}"
        )
    return learner


def training(task: UnlearningTask, base: NoUnlearning, seed: int) -> dict[str, Any]:
    """The keyword arguments every arm's model trains with.

    The undefended learner's Adam settings (epochs, batch size, learning rate), the
    run's seed, and the task's model: the layers to adapt and the head to train.
    """
    return {
        "epochs": base.epochs,
        "batch_size": base.batch_size,
        "lr": base.lr,
        "seed": seed,
        "target_modules": task.targets,
        "head": task.head,
    }


@dataclass(frozen=True)
class UnlearningLearner:
    """Fit an exact-unlearning model, serve the task's deletions, retrain by policy."""

    defense: UnlearningDefense
    base: NoUnlearning

    def fit(self, task: UnlearningTask, rng: np.random.Generator) -> Unlearner:
        """Train, delete ``task.forget``, and retrain if the policy asks for it."""
        model = self.defense.build(task, self.base, int(rng.integers(2**31)))
        model.fit(task.X, task.y, task.ids, task.groups)
        if task.forget.size:
            receipt = model.delete(task.forget)
            if self.defense.retrain == "always" or receipt.all_dead:
                model.retrain()
        return model


class UnlearningDefense(ABC):
    """What the three unlearning defenses share: how they wrap and what they certify.

    A subclass is a frozen dataclass that names itself and its ``estimator``, and
    holds its ``retrain`` policy and the estimator's settings (``shards``,
    ``slices``, ...) as fields of the same names; :meth:`build` makes the unfitted
    model from them, :meth:`wrap` swaps the undefended training for it and
    :meth:`certify` audits the served system's lineage.
    """

    name: ClassVar[str]
    kind: ClassVar[DefenseKind] = DefenseKind.TRAINER
    estimator: ClassVar[Callable[..., Unlearner]]
    retrain: Policy

    def __post_init__(self) -> None:
        """Check the policy and the grid (``shards``, ``slices``) where it is held."""
        owner = type(self).__name__
        check_choice(f"{owner}.retrain", self.retrain, POLICIES)
        for grid in ("shards", "slices"):
            if hasattr(self, grid):
                check_int(f"{owner}.{grid}", getattr(self, grid), minimum=1)

    def build(self, task: UnlearningTask, base: NoUnlearning, seed: int) -> Unlearner:
        """The unfitted model, with the undefended learner's training settings.

        :attr:`estimator` called with the task's backbone, the undefended learner's
        rank and :func:`training`, and this defense's fields but ``retrain``.
        """
        settings = values_of(type(self), self)
        settings.pop("retrain", None)
        return type(self).estimator(
            task.backbone, rank=base.rank, **settings, **training(task, base, seed)
        )

    def wrap(self, learner: Learner[Any, Any]) -> UnlearningLearner:
        """Replace the undefended training by this defense's model."""
        return UnlearningLearner(self, _base(learner, self.name))

    def certify(self, system: Unlearner, task: UnlearningTask) -> dict[str, float]:
        """Exactness (1.0: no stored component saw a deleted id) and what is served."""
        report = lineage_audit(system, task.forget.tolist())
        served = system.served()
        return {
            "exact": float(report.clean),
            "stored_groups": float(len(system.lineage())),
            "served_depth": float(np.mean([len(p) for p in served]) / system.slices),
        }


@dataclass(frozen=True)
class S3TDefense(UnlearningDefense):
    """S3T as a harness defense (see :class:`defenses.s3t.defense.S3T`).

    Parameters
    ----------
    shards, slices : int
        ``m`` and ``L``.
    sequences : int or None
        Orders per shard ``B`` (``L`` if None).
    selection : {"cyclic", "bms"}
        Order selection.
    retrain : {"when_dead", "always"}
        Retrain once every shard is dead, or after every deletion.
    """

    name: ClassVar[str] = "s3t-s3t"
    estimator: ClassVar[Callable[..., Unlearner]] = S3T
    shards: int = 3
    slices: int = 3
    sequences: int | None = None
    selection: Selection = "cyclic"
    retrain: Policy = "when_dead"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sequences is not None:
            check_int("S3TDefense.sequences", self.sequences, minimum=1)
        check_choice("S3TDefense.selection", self.selection, ("cyclic", "bms"))


@dataclass(frozen=True)
class SISADefense(UnlearningDefense):
    """SISA as a harness defense (see :class:`defenses.s3t.baselines.SISA`)."""

    name: ClassVar[str] = "s3t-sisa"
    estimator: ClassVar[Callable[..., Unlearner]] = SISA
    shards: int = 3
    slices: int = 3
    retrain: Policy = "always"


@dataclass(frozen=True)
class FullRetrainDefense(UnlearningDefense):
    """Retrain from scratch without the deleted points."""

    name: ClassVar[str] = "s3t-full-retrain"
    estimator: ClassVar[Callable[..., Unlearner]] = FullRetrain
    retrain: Policy = field(default="always", init=False)
