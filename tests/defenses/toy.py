"""A tiny game for harness tests: the secret is a coin, the system leaks it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from defenses.api import DefenseKind
from defenses.oracle import QueryOracle
from defenses.threat import Budget, Capability, Goal, Knowledge, Stage, ThreatModel


@dataclass(frozen=True)
class Task:
    secret: np.ndarray
    split_draw: float


@dataclass
class System:
    secret: np.ndarray
    init_draw: float
    noise: float = 0.0

    def predict(self, x):
        p = np.clip(self.secret[x[:, 0].astype(int)] * (1 - self.noise), 0, 1)
        return np.c_[1 - p, p]


@dataclass(frozen=True)
class Learner:
    def fit(self, task, rng):
        return System(task.secret.astype(float), float(rng.random()))


@dataclass(frozen=True)
class ToyScenario:
    name: ClassVar[str] = "toy"
    headline: ClassVar[tuple[str, str]] = ("accuracy", "accuracy")
    chance: ClassVar[dict[str, float]] = {"accuracy": 0.5}
    n: int = 200
    queries: int | None = None

    @property
    def threat(self):
        return ThreatModel(
            Goal.CONFIDENTIALITY,
            Stage.DEPLOYMENT,
            Knowledge.BLACK_BOX,
            frozenset({Capability.QUERY_SCORES}),
            Budget(queries=self.queries),
        )

    def setup(self, rng):
        return Task(rng.random(self.n) < 0.5, float(rng.random()))

    def learner(self):
        return Learner()

    def utility(self, system, task):
        return {"accuracy": 1.0 - system.noise, "init_draw": system.init_draw}

    def expose(self, system, task, known_defense):
        return QueryOracle.granted_by(system.predict, self.threat), self.n

    def judge(self, system, task, guess):
        return {"accuracy": float(np.mean(guess == task.secret))}

    def random_guess(self, task, rng):
        return rng.random(self.n) < 0.5


@dataclass(frozen=True)
class ReadScores:
    name: ClassVar[str] = "read-scores"
    requires: ClassVar[frozenset[Capability]] = frozenset({Capability.QUERY_SCORES})

    def run(self, view, rng):
        oracle, n = view
        return (
            oracle(np.arange(n)[:, None].astype(float))[:, 1] > 0.5 - rng.random() * 0
        )


@dataclass(frozen=True)
class NeedsWeights:
    name: ClassVar[str] = "needs-weights"
    requires: ClassVar[frozenset[Capability]] = frozenset({Capability.READ_PARAMETERS})

    def run(self, view, rng):
        raise AssertionError("never runs")


@dataclass
class NoisyLearner:
    inner: Learner
    noise: float

    def fit(self, task, rng):
        system = self.inner.fit(task, rng)
        system.noise = self.noise
        return system


@dataclass(frozen=True)
class Blur:
    name: ClassVar[str] = "blur"
    kind: ClassVar[DefenseKind] = DefenseKind.POSTPROCESSOR
    noise: float = 0.6

    def wrap(self, learner):
        return NoisyLearner(learner, self.noise)


@dataclass
class MutatingDefense:
    name: ClassVar[str] = "mutator"
    kind: ClassVar[DefenseKind] = DefenseKind.POSTPROCESSOR
    log: list = field(default_factory=list)

    def wrap(self, learner):
        object.__setattr__(learner, "tampered", True)
        return learner
