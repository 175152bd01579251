"""Harness wiring for output post-processors: SSD as a learner-to-learner defense.

A post-processing defense fits the inner learner unchanged (same randomness, so the
defended and undefended arms share the trained model), then builds a post-processor
from the fitted system and the task's validation split, and answers every query
through it. :class:`SSDDefense` is the paper's defense; the peers and ablations in
:mod:`defenses.ssd.baselines` reuse the same wiring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from defenses.api import DefenseKind, Learner
from defenses.arrays import FloatArray
from defenses.checks import check_choice, check_real
from defenses.data import Dataset
from defenses.ssd.defense import StealthyShield
from defenses.ssd.seeding import SEEDINGS, Seeding


class Deployed(Protocol):
    """A fitted classifier: defended answers and the undefended ones behind them."""

    def predict_proba(self, X: FloatArray) -> FloatArray:
        """The answer a query receives."""
        ...

    def clean_proba(self, X: FloatArray) -> FloatArray:
        """The undefended model's probabilities (for distortion metrics)."""
        ...


class PostProcessor(Protocol):
    """Maps a batch of probabilities (and the queries behind them) to answers."""

    def __call__(self, probs: FloatArray, inputs: FloatArray) -> FloatArray:
        """Post-processed answers."""
        ...


class HasValidation(Protocol):
    """A task with a held-out validation split of the private data."""

    @property
    def val(self) -> Dataset:
        """The validation split."""
        ...


class PostProcessorFactory(Protocol):
    """Builds a post-processor for a fitted system."""

    name: ClassVar[str]

    def build(
        self, system: Deployed, task: HasValidation, rng: np.random.Generator
    ) -> PostProcessor:
        """A post-processor fitted to ``system`` (e.g. on the validation split)."""
        ...


@dataclass(frozen=True, eq=False)
class PostProcessed:
    """A deployed system whose answers pass through a post-processor."""

    inner: Deployed
    post: PostProcessor

    def predict_proba(self, X: FloatArray) -> FloatArray:
        """Post-processed answers."""
        return np.asarray(self.post(self.inner.predict_proba(X), X), dtype=np.float64)

    def clean_proba(self, X: FloatArray) -> FloatArray:
        """The undefended probabilities."""
        return self.inner.clean_proba(X)


@dataclass(frozen=True)
class PostProcessedLearner:
    """Fit the inner learner, then attach the factory's post-processor."""

    inner: Learner[Any, Deployed]
    factory: PostProcessorFactory

    def fit(self, task: HasValidation, rng: np.random.Generator) -> PostProcessed:
        """Fit the inner learner with ``rng`` first, then build the post-processor."""
        system = self.inner.fit(task, rng)
        return PostProcessed(system, self.factory.build(system, task, rng))


def check_number(owner: str, name: str, value: Any, low: float, high: float) -> None:
    """Raise ValueError unless ``value`` is a finite number in ``[low, high]``."""
    check_real(f"{owner}.{name}", value, low, high)


@dataclass(frozen=True, eq=False)
class _ShieldCall:
    """A fitted shield as a post-processor (the query is the hash input)."""

    shield: StealthyShield

    def __call__(self, probs: FloatArray, inputs: FloatArray) -> FloatArray:
        return np.asarray(self.shield(probs, inputs=inputs), dtype=np.float64)


@dataclass(frozen=True)
class SSDDefense:
    """The Stealthy Shield Defense as a harness defense (post-processor).

    Parameters
    ----------
    epsilon : float
        Distortion controller; budget ``epsilon * H(f)``, in (0, 100].
    temperature : float or None
        Sampling temperature on probabilities; None uses the K rule
        :func:`~defenses.ssd.defense.default_temperature`.
    seeding : {"random", "input-hash"}
        Fresh randomness per answer, or a keyed hash of the query.
    hash_resolution : float or None
        Input grid for hashing (``"input-hash"`` only).
    """

    name: ClassVar[str] = "ssd-shield"
    kind: ClassVar[DefenseKind] = DefenseKind.POSTPROCESSOR
    shield_class: ClassVar[type[StealthyShield]] = StealthyShield
    """The shield built by :meth:`shield` (the ablations swap in a variant)."""
    epsilon: float = 0.5
    temperature: float | None = None
    seeding: Seeding = "random"
    hash_resolution: float | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_number(owner, "epsilon", self.epsilon, 1e-9, 100.0)
        if self.temperature is not None:
            check_number(owner, "temperature", self.temperature, 1e-6, 1e6)
        check_choice(f"{owner}.seeding", self.seeding, SEEDINGS)
        if self.hash_resolution is not None:
            check_number(owner, "hash_resolution", self.hash_resolution, 1e-12, 1e6)
            if self.seeding != "input-hash":
                raise ValueError(f"{owner}.hash_resolution needs seeding='input-hash'")

    def shield(self, seed: int) -> StealthyShield:
        """An unfitted :attr:`shield_class` with this defense's parameters."""
        return self.shield_class(
            epsilon=self.epsilon,
            temperature=self.temperature,
            seed=seed,
            seeding=self.seeding,
            hash_resolution=self.hash_resolution,
        )

    def build(
        self, system: Deployed, task: HasValidation, rng: np.random.Generator
    ) -> PostProcessor:
        """Fit the prototypes on the undefended outputs of the validation split."""
        shield = self.shield(int(rng.integers(2**62)))
        shield.fit(system.clean_proba(task.val.X), task.val.y)
        return _ShieldCall(shield)

    def wrap(self, learner: Learner[Any, Deployed]) -> PostProcessedLearner:
        """Return the learner whose fitted system answers through SSD."""
        return PostProcessedLearner(learner, self)
