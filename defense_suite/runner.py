"""Run a spec: every scenario setting, attack setting and defense arm, seed by seed.

:func:`plan` builds every component of a spec before anything runs, so a bad
parameter fails at once with the spec file, the section and the setting in the
message; :func:`run_plan` then plays the games, skipping the records a results file
already holds (``--resume``). A record is identified by its :data:`RecordKey`: the
spec, the arm (scenario, attack, defense and their parameters) and the seed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from defense_suite.extras import require_for
from defense_suite.spec import Spec, SpecError
from defenses.harness import label, params_of, run_once
from defenses.registry import create, load
from defenses.results import UNDEFENDED, Result
from defenses.threat import ThreatModelViolation

logger = logging.getLogger(__name__)

RecordKey = tuple[str, str, str, str, str, int]
"""(spec, scenario, attack label, defense label, parameters as JSON, seed)."""


def _params_json(params: Mapping[str, Any]) -> str:
    # round-trip through JSON so tuples and lists, ints and floats compare as stored
    return json.dumps(json.loads(json.dumps(params)), sort_keys=True)


def record_key(result: Result) -> RecordKey:
    """The key of a stored record (its spec is ``meta["spec"]``)."""
    return (
        str(result.meta.get("spec", "")),
        result.scenario,
        result.attack,
        result.defense,
        _params_json(result.params),
        result.seed,
    )


@dataclass(frozen=True)
class Game:
    """One (scenario, attack, arm, seed) game of a spec, built and checked."""

    spec: str
    scenario: Any
    attack: Any
    defense: Any | None
    seed: int

    @property
    def key(self) -> RecordKey:
        """The key its record will have."""
        params = {
            "scenario": params_of(self.scenario),
            "attack": params_of(self.attack),
            "defense": params_of(self.defense),
        }
        return (
            self.spec,
            self.scenario.name,
            label(self.attack),
            label(self.defense),
            _params_json(params),
            self.seed,
        )

    def describe(self) -> str:
        """``scenario / attack / defense seed=N`` for progress lines."""
        return (
            f"{self.scenario.name} / {label(self.attack)} / {label(self.defense)} "
            f"seed={self.seed}"
        )


@dataclass(frozen=True)
class Plan:
    """Everything a spec will run: games, or measurement calls for a benchmark spec."""

    spec: Spec
    seeds: list[int]
    games: list[Game]
    measurements: list[tuple[Callable[..., Iterable[Result]], dict[str, Any]]]

    @property
    def size(self) -> int:
        """Games to play, or measurement settings times seeds."""
        return len(self.games) or len(self.measurements) * len(self.seeds)


def _build(kind: str, name: str, setting: Mapping[str, Any], where: str) -> Any:
    try:
        return create(kind, name, setting)  # type: ignore[arg-type]
    except KeyError as error:
        raise SpecError(f"{where}: {error.args[0]}") from error
    except (ValueError, TypeError) as error:
        shown = ", ".join(f"{k}={v!r}" for k, v in setting.items())
        raise SpecError(f"{where} {name}({shown}): {error}") from error


def plan(spec: Spec, seeds: Sequence[int] | None = None, source: str = "") -> Plan:
    """Build and check every component of ``spec`` (``seeds`` overrides its seeds).

    Raises
    ------
    SpecError
        Naming ``source`` (the spec file), the section and the setting, when a
        component is unknown, refuses a parameter, or an attack needs a capability
        its scenario's threat model does not grant.
    MissingExtra
        When a component needs an optional library that is not installed, with the
        ``pip install`` line that installs it (before anything runs).
    """
    where = source or spec.name
    names = [spec.scenario, spec.benchmark, *spec.attacks, *spec.defenses]
    require_for([n for n in names if n is not None and n != UNDEFENDED], where)
    chosen = list(spec.seeds if seeds is None else seeds)
    if not chosen or any(isinstance(s, bool) or s < 0 for s in chosen):
        raise SpecError(f"seeds must be integers >= 0, got {chosen}")
    if spec.benchmark is not None:
        try:
            function = load("benchmarks", spec.benchmark)
        except KeyError as error:
            raise SpecError(f"{where}: benchmark: {error.args[0]}") from error
        return Plan(
            spec, chosen, [], [(function, s) for s in spec.benchmark_settings()]
        )
    if spec.scenario is None:
        raise SpecError(f"{where}: a game spec needs a scenario")
    arms: list[Any | None] = []
    for name in spec.defenses:
        if name == UNDEFENDED:
            arms.append(None)
            continue
        for setting in spec.component_settings("defense", name):
            arms.append(
                _build("defenses", name, setting, f"{where}: [params.defense.{name}]")
            )
    games = []
    for setting in spec.scenario_settings():
        scenario = _build(
            "scenarios", spec.scenario, setting, f"{where}: [params.scenario]"
        )
        for attack_name in spec.attacks:
            for a_setting in spec.component_settings("attack", attack_name):
                attack = _build(
                    "attacks",
                    attack_name,
                    a_setting,
                    f"{where}: [params.attack.{attack_name}]",
                )
                try:
                    scenario.threat.require(attack.requires, f"attack {attack.name!r}")
                except ThreatModelViolation as error:
                    raise SpecError(f"{where}: {error}") from error
                games += [
                    Game(spec.name, scenario, attack, arm, seed)
                    for seed in chosen
                    for arm in arms
                ]
    return Plan(spec, chosen, games, [])


def run_plan(
    chosen: Plan,
    skip: Iterable[RecordKey] = (),
    check: Callable[[], None] | None = None,
) -> Iterator[Result]:
    """Yield the plan's results, leaving out every record whose key is in ``skip``.

    ``check`` is called after each game or measurement call returns and before its
    results are yielded; raising there (an interrupt seen while a library swallowed
    it) drops the results of the call it follows. Each finished game logs one line.
    """
    done = set(skip)
    meta = {"spec": chosen.spec.name}
    total = chosen.size
    bar = tqdm(total=total, desc=chosen.spec.name, disable=None, leave=False)
    with bar:
        for number, game in enumerate(chosen.games, 1):
            bar.update()
            if game.key in done:
                logger.info(
                    "[%d/%d] %s: in the results already", number, total, game.describe()
                )
                continue
            bar.set_postfix_str(game.describe())
            start = time.perf_counter()
            result = run_once(game.scenario, game.attack, game.defense, game.seed, meta)
            if check is not None:
                check()
            logger.info(
                "[%d/%d] %s done in %.1f s",
                number,
                total,
                game.describe(),
                time.perf_counter() - start,
            )
            yield result
        for number, (function, setting) in enumerate(chosen.measurements, 1):
            bar.update(len(chosen.seeds))
            start = time.perf_counter()
            try:
                results = [
                    dataclasses.replace(r, meta={**r.meta, **meta})
                    for r in function(setting, chosen.seeds)
                ]
            except (ValueError, TypeError) as error:
                # a measurement checks its parameters when it runs: name the spec
                raise SpecError(
                    f"{chosen.spec.name}: [params.benchmark] {setting}: {error}"
                ) from error
            if check is not None:
                check()
            fresh = [r for r in results if record_key(r) not in done]
            logger.info(
                "[%d/%d] %s %s seeds=%s: %d records (%d in the results already) "
                "in %.1f s",
                number,
                len(chosen.measurements),
                chosen.spec.benchmark,
                setting,
                chosen.seeds,
                len(fresh),
                len(results) - len(fresh),
                time.perf_counter() - start,
            )
            done.update(record_key(r) for r in fresh)
            yield from fresh
