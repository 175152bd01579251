"""Harness wiring of S3T: a canary audit of deletions on digits.

The game (research note §5.2, item 4): an auditor plants mislabelled canaries (one
user's data, so they share a partition key), the service fine-tunes on the pool and
the canaries, the auditor requests their deletion, then queries the deployed model
for the planted labels. Its scores on the deleted canaries are compared with its
scores on canaries that were never trained on (the reference): AUC 0.5 means the
deleted canaries left no trace. The undefended service drops the rows but keeps the
model; the defenses (S3T, SISA, full retraining) unlearn exactly.

This module registers every scenario, attack, defense, benchmark and figure of the
package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt
from torch import nn

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_int
from defenses.fields import owner_key
from defenses.metrics import accuracy
from defenses.reference.membership import Members, MembershipRules
from defenses.registry import register, register_package
from defenses.s3t.arms import (
    FullRetrainDefense,
    NoUnlearning,
    S3TDefense,
    SISADefense,
)
from defenses.s3t.attacks import CanaryAttack
from defenses.s3t.benchmark import deletion_benchmark
from defenses.s3t.defense import Unlearner
from defenses.s3t.figures import figures
from defenses.s3t.tasks import (
    CANARY_GROUP,
    CANARY_ID_BASE,
    Kind,
    ModelSettings,
    pretrained_backbone,
    split_digits,
)
from defenses.threat import Capability, Goal, ThreatModel

register_package(
    attacks=[CanaryAttack],
    defenses=[S3TDefense, SISADefense, FullRetrainDefense],
    benchmarks={"s3t-deletion": deletion_benchmark},
    figures={"s3t": figures},
)


@dataclass(frozen=True)
class CanaryTask:
    """Training data with planted canaries, deletion requests, test set, secrets."""

    backbone: nn.Module
    targets: list[str] | None
    head: str | None
    X: FloatArray
    y: IntArray
    ids: IntArray
    groups: IntArray
    forget: IntArray
    test_X: FloatArray
    test_y: IntArray
    candidates: FloatArray
    planted: IntArray
    was_trained: npt.NDArray[np.bool_]


@register("scenarios", "s3t-canary-deletion")
@dataclass(frozen=True)
class CanaryDeletion(MembershipRules[Unlearner, CanaryTask], ModelSettings):
    """Canary audit of deletions on digits with a frozen pretrained backbone.

    Parameters
    ----------
    canaries : int
        Canaries planted and deleted (as many never-trained ones are the reference).
    repeats : int
        Copies of each canary planted (distinct ids, one user).
    pool : int
        Fine-tuning pool size (0: every image not public, test or canary).
    public, width, hidden, blocks, pretrain_epochs, rank, epochs, lr
        The backbone and the adapters' Adam training
        (:class:`~defenses.s3t.tasks.ModelSettings`; for the transformer, width,
        hidden and blocks are the model width, feed-forward width and encoder
        layers).
    test_fraction : float
        Share of the non-public images kept for testing.
    model : {"residual", "transformer"}
        The pretrained model: the built-in residual MLP, or a user-style
        ``torch.nn.TransformerEncoder`` (:class:`~defenses.s3t.tasks.RowTransformer`,
        adapters on every layer's ``linear1`` and ``linear2``).
    batch_size : int
        Adam batch size of every arm.
    """

    name: ClassVar[str] = "s3t-canary-deletion"
    headline: ClassVar[tuple[str, str]] = ("accuracy", "auc")
    chance: ClassVar[Mapping[str, float]] = {"auc": 0.5, "advantage": 0.0}
    canaries: int = 10
    repeats: int = 5
    pool: int = 0
    test_fraction: float = 0.25
    batch_size: int = 64
    model: Kind = "residual"

    def __post_init__(self) -> None:
        check_int("CanaryDeletion.canaries", self.canaries, 2, 100)
        check_int("CanaryDeletion.pool", self.pool, minimum=0)
        self.check_model_settings(owner_key(self), self.model)
        for name in ("batch_size", "repeats"):
            check_int(f"CanaryDeletion.{name}", getattr(self, name), minimum=1)

    @property
    def threat(self) -> ThreatModel:
        """Black-box scores; the auditor owns the canaries and requests deletion."""
        return ThreatModel.granting(
            Goal.CONFIDENTIALITY, Capability.QUERY_SCORES, Capability.REQUEST_DELETION
        )

    def setup(self, rng: np.random.Generator) -> CanaryTask:
        """Split digits, pretrain the backbone (cached per seed), plant canaries."""
        split = split_digits(rng, self.public, self.test_fraction, self.canaries)
        data = split.data
        pool = split.pool
        if self.pool:
            if self.pool > pool.size:
                raise ValueError(
                    f"pool={self.pool} exceeds the {pool.size} images left"
                )
            pool = np.sort(rng.choice(pool, self.pool, replace=False))
        spec = self.backbone_spec(self.model)
        backbone = pretrained_backbone(int(rng.integers(2**31)), split.public, spec)
        planted_n = self.canaries * self.repeats
        canary_ids = CANARY_ID_BASE + np.arange(planted_n, dtype=np.int64)
        copies = np.tile(split.canaries_in, self.repeats)
        X = np.concatenate([data.X[pool], data.X[copies]])
        y = np.concatenate([data.y[pool], np.tile(split.flipped_in, self.repeats)])
        ids = np.concatenate([pool, canary_ids])
        groups = np.concatenate([pool, np.full(planted_n, CANARY_GROUP)])
        order = rng.permutation(2 * self.canaries)
        candidates = np.concatenate(
            [data.X[split.canaries_in], data.X[split.canaries_out]]
        )
        planted = np.concatenate([split.flipped_in, split.flipped_out])
        trained = np.r_[np.ones(self.canaries, bool), np.zeros(self.canaries, bool)]
        return CanaryTask(
            backbone=backbone,
            targets=spec.targets,
            head=spec.head,
            X=X,
            y=y,
            ids=ids,
            groups=groups,
            forget=canary_ids,
            test_X=data.X[split.test],
            test_y=data.y[split.test],
            candidates=candidates[order],
            planted=planted[order],
            was_trained=trained[order],
        )

    def learner(self) -> NoUnlearning:
        """The undefended service: one LoRA model, deletions drop rows only."""
        return NoUnlearning(self.rank, self.epochs, self.batch_size, self.lr)

    def utility(self, system: Unlearner, task: CanaryTask) -> dict[str, float]:
        """Test accuracy after the deletions were served."""
        return {"accuracy": accuracy(system.predict(task.test_X), task.test_y)}

    def membership(self, task: CanaryTask) -> Members:
        """The canaries, their planted labels, and which were trained on (deleted)."""
        return Members(task.candidates, task.planted, task.was_trained)

    def judge(
        self, system: Unlearner, task: CanaryTask, guess: FloatArray | None
    ) -> dict[str, float]:
        """Membership metrics (deleted vs never-trained canaries) and the flip gap.

        ``flip_gap`` is the mean probability of the planted label on the deleted
        canaries minus that on the never-trained ones (0 when nothing is left).
        """
        metrics = super().judge(system, task, guess)
        probs = system.predict_proba(task.candidates)
        planted = probs[np.arange(task.planted.size), task.planted]
        gap = planted[task.was_trained].mean() - planted[~task.was_trained].mean()
        return {**metrics, "flip_gap": float(gap)}

    def random_guess(self, task: CanaryTask, rng: np.random.Generator) -> FloatArray:
        """A blind guess: the same score for every canary (AUC exactly 0.5)."""
        return np.zeros(task.planted.size)
