"""Run a spec: every scenario setting, attack setting and defense arm, seed by seed."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from benchmarks.spec import Spec
from defenses.harness import evaluate
from defenses.registry import create, load
from defenses.results import UNDEFENDED, Result

logger = logging.getLogger(__name__)


def _defense_arms(spec: Spec) -> list[Any | None]:
    arms: list[Any | None] = []
    for name in spec.defenses:
        if name == UNDEFENDED:
            arms.append(None)
            continue
        arms.extend(
            create("defenses", name, s)
            for s in spec.component_settings("defense", name)
        )
    return arms


def run_spec(
    spec: Spec, seeds: Sequence[int] | None = None, progress: bool = True
) -> Iterator[Result]:
    """Yield the results of ``spec`` (``seeds`` overrides the spec's seeds)."""
    chosen = list(seeds) if seeds is not None else spec.seeds
    meta = {"spec": spec.name}
    if spec.benchmark is not None:
        function = load("benchmarks", spec.benchmark)
        for setting in spec.benchmark_settings():
            for result in function(setting, chosen):
                yield dataclasses.replace(result, meta={**result.meta, **meta})
        return
    assert spec.scenario is not None
    arms = _defense_arms(spec)
    for scenario_setting in spec.scenario_settings():
        scenario = create("scenarios", spec.scenario, scenario_setting)
        for attack_name in spec.attacks:
            for attack_setting in spec.component_settings("attack", attack_name):
                attack = create("attacks", attack_name, attack_setting)
                yield from evaluate(scenario, attack, arms, chosen, meta, progress)
