"""Contract checks every package runs on itself.

In the spirit of scikit-learn's ``check_estimator``.

:func:`check_pair` plays the game a few times and asserts what every scenario, attack
and defense must satisfy, whatever the package; :func:`make_result` builds a valid
result record for tests of the result tooling. The bad-input rule's
:func:`assert_rule` and its hypothesis strategies (:func:`bad_reals`,
:func:`bad_arrays`, :func:`probability_rows`) live in :mod:`defenses.rule` and are
re-exported here, so a package's tests import every shared check from one place.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from typing import Any

import numpy as np

from defenses.api import Scenario
from defenses.harness import run_once
from defenses.results import Result
from defenses.rule import (
    EXTREME_REALS,
    SLOW_ENV,
    VALID_NUMPY_SCALARS,
    WRONG_TYPES,
    assert_rule,
    bad_arrays,
    bad_reals,
    probability_rows,
    rule_settings,
)
from defenses.threat import Stage

__all__ = [
    "EXTREME_REALS",
    "SLOW_ENV",
    "VALID_NUMPY_SCALARS",
    "WRONG_TYPES",
    "ContractError",
    "assert_rule",
    "bad_arrays",
    "bad_reals",
    "check_pair",
    "check_result",
    "make_result",
    "probability_rows",
    "rule_settings",
]

RATE_PREFIXES = (
    "auc",
    "advantage",
    "tpr",
    "fpr",
    "accuracy",
    "acc",
    "coverage",
    "rate",
    "fraction",
    "top",
)


class ContractError(AssertionError):
    """A scenario, attack or defense broke the shared contract."""


def _fail(message: str) -> None:
    raise ContractError(message)


def _is_rate(name: str) -> bool:
    return name.split("@")[0].split("_")[0].lower() in RATE_PREFIXES or name.endswith(
        "_rate"
    )


def check_result(result: Result) -> None:
    """A single result serializes to JSON and its rate metrics lie in [0, 1]."""
    text = json.dumps(result.to_dict())
    if Result.from_dict(json.loads(text)) != result:
        _fail("result does not survive a JSON round trip")
    for section in ("utility", "success"):
        for name, value in getattr(result, section).items():
            if _is_rate(name) and not 0.0 <= value <= 1.0:
                _fail(f"{section}.{name} = {value} is a rate but lies outside [0, 1]")


def make_result(defense: str = "none", seed: int = 0, **fields: Any) -> Result:
    """A valid :class:`Result` for tests: ``fields`` over placeholder values.

    The placeholders are scenario ``"s"``, attack ``"a"`` and empty threat, utility,
    success and cost sections, so a test states only the fields it is about.
    """
    record: dict[str, Any] = {
        "scenario": "s",
        "attack": "a",
        "defense": defense,
        "seed": seed,
        "threat": {},
        "utility": {},
        "success": {},
        "cost": {},
    }
    return Result(**{**record, **fields})


def check_pair(
    scenario: Scenario[Any, Any, Any, Any],
    attack: Any,
    defense: Any,
    seed: int = 0,
    chance_tolerance: float = 0.1,
    min_gap: float = 0.05,
) -> tuple[Result, Result]:
    """Assert the shared contract on one (scenario, attack, defense) triple.

    Checks, in order:

    1. scenario, attack and defense are dataclasses (their fields are the parameters);
    2. ``defense.wrap`` does not mutate the learner it wraps;
    3. the same seed gives identical utility and success, for both arms;
    4. the defended and undefended arms report the same metric names;
    5. results serialize to JSON and rates lie in [0, 1];
    6. the query budget of the threat model holds;
    7. a guess made without looking at the system scores within
       ``chance_tolerance`` of ``scenario.chance`` (skipped if the scenario has no
       such guess, e.g. at the training stage);
    8. the undefended attack beats chance by at least ``min_gap`` on the headline
       success metric.

    Returns the undefended and defended results.
    """
    for role, component in (
        ("scenario", scenario),
        ("attack", attack),
        ("defense", defense),
    ):
        if not dataclasses.is_dataclass(component):
            _fail(f"{role} {component!r} must be a dataclass")

    learner = scenario.learner()
    before = pickle.dumps(learner)
    defense.wrap(copy.copy(learner))
    defense.wrap(learner)
    if pickle.dumps(learner) != before:
        _fail(f"defense {defense.name!r}.wrap mutated the learner it wrapped")

    undefended = run_once(scenario, attack, None, seed)
    defended = run_once(scenario, attack, defense, seed)
    for arm, first in (("undefended", undefended), ("defended", defended)):
        again = run_once(
            scenario, attack, None if arm == "undefended" else defense, seed
        )
        for section in ("utility", "success"):
            if getattr(again, section) != getattr(first, section):
                _fail(
                    f"{arm} arm is not reproducible at seed {seed}: {section} "
                    f"{dict(getattr(first, section))} then "
                    f"{dict(getattr(again, section))}"
                )

    for section in ("utility", "success"):
        a, b = set(getattr(undefended, section)), set(getattr(defended, section))
        if a != b:
            _fail(f"arms report different {section} metrics: {sorted(a ^ b)}")

    for result in (undefended, defended):
        check_result(result)
        budget = scenario.threat.budget.queries
        if budget is not None and result.cost.get("queries", 0.0) > budget:
            _fail(f"{result.cost['queries']} queries used, budget {budget}")

    _, success_metric = scenario.headline
    chance = scenario.chance.get(success_metric)
    if chance is None:
        _fail(
            f"scenario.chance has no entry for the headline metric {success_metric!r}"
        )
    assert chance is not None
    if scenario.threat.stage is Stage.DEPLOYMENT:
        rng = np.random.default_rng(seed)
        task = scenario.setup(rng)
        guess = scenario.random_guess(task, rng)
        if guess is not None:
            system = scenario.learner().fit(task, rng)
            score = float(scenario.judge(system, task, guess)[success_metric])
            if abs(score - chance) > chance_tolerance:
                _fail(
                    f"a blind guess scores {success_metric}={score:.3f}, chance is "
                    f"{chance:.3f}: the judge is broken"
                )
    strength = undefended.success[success_metric]
    if strength < chance + min_gap:
        _fail(
            f"the undefended attack scores {success_metric}={strength:.3f}, not "
            f"clearly above chance {chance:.3f}: too weak to test a defense with"
        )
    return undefended, defended
