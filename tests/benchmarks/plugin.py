"""Test-only components for the command-line tests (registered on import).

``slow-digits-membership`` is the reference game whose learner logs each fit to the
file named by ``$DEFENSE_SUITE_TEST_FITS``; from the second fit on it trains
scikit-learn's MLP for a very long time (the interrupted-run test sends SIGINT
then: the MLP catches the KeyboardInterrupt and returns a part-trained model).
``failing-defense`` raises while fitting (a run that fails after its first arm).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sklearn.neural_network import MLPClassifier

from defenses.reference.scenario import DigitsMembership, MLPLearner
from defenses.registry import register


@dataclass(frozen=True)
class SlowSecondFit(MLPLearner):
    def fit(self, task, rng):
        log = Path(os.environ["DEFENSE_SUITE_TEST_FITS"])
        with log.open("a") as handle:
            handle.write("fit\n")
        if len(log.read_text().splitlines()) < 2:
            return super().fit(task, rng)
        model = MLPClassifier(
            hidden_layer_sizes=(256,),
            max_iter=1_000_000,
            tol=0.0,
            n_iter_no_change=1_000_000,
            random_state=0,
        )
        return model.fit(task.train.X, task.train.y)


@register("scenarios", "slow-digits-membership")
@dataclass(frozen=True)
class SlowDigitsMembership(DigitsMembership):
    name: ClassVar[str] = "slow-digits-membership"

    def learner(self):
        return SlowSecondFit()


@dataclass(frozen=True)
class _Failing:
    inner: object

    def fit(self, task, rng):
        raise RuntimeError("failing-defense fails while fitting")


@register("defenses", "failing-defense")
@dataclass(frozen=True)
class FailingDefense:
    name: ClassVar[str] = "failing-defense"

    def wrap(self, learner):
        return _Failing(learner)


@register("benchmarks", "test-counter")
def counter(params, seeds):
    """A measurement benchmark: one record per seed and variant."""
    from defenses.harness import measurement

    if params.get("refuse"):
        raise ValueError("test-counter: unknown parameter(s) ['refuse']")
    for seed in seeds:
        for variant in ("none", "fast"):
            yield measurement(
                "test-counter",
                variant,
                seed,
                cost={"seconds": 1.0 + seed},
                params=params,
            )
