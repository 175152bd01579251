"""Run an attack against the undefended and the defended system, seed by seed.

Every arm of one :func:`evaluate` call shares its seeds: the seed is split with
:class:`numpy.random.SeedSequence` into independent streams for the scenario's
set-up (data split, secrets), the learner's fit (initialisation) and the attack, so
the undefended and defended arms see the same split and initialisation (common random
numbers) and changing the attack never changes the trained model. Tables then report
paired deltas (defended minus undefended, same seed).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import platform
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from defenses.api import Certifiable, Scenario
from defenses.cost import phase, recording
from defenses.results import UNDEFENDED, Result
from defenses.threat import Stage, ThreatModel

logger = logging.getLogger(__name__)

_VERSIONED = ("numpy", "scipy", "torch", "scikit-learn", "opacus", "flwr", "tenseal")


def game_streams(seed: int, n: int = 3) -> tuple[np.random.Generator, ...]:
    """The independent streams of one seeded game, as :func:`run_once` draws them.

    ``SeedSequence(seed).spawn(n)``, one generator per child: for ``n = 3`` the
    scenario's set-up, the learner's fit and the attack. A benchmark that plays a game
    by hand uses it so that its runs see the same split and initialisation as the
    harness's at the same seed.
    """
    children = np.random.SeedSequence(seed).spawn(n)
    return tuple(np.random.default_rng(child) for child in children)


@functools.cache
def _installed_versions() -> tuple[tuple[str, str], ...]:
    from importlib import metadata

    found = [("python", platform.python_version())]
    for name in _VERSIONED:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return tuple(found)


def versions() -> dict[str, str]:
    """Python and installed library versions, for ``Result.meta`` (read once)."""
    return dict(_installed_versions())


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    try:
        json.dumps(value)
    except TypeError:
        return repr(value)
    return value


def params_of(component: object | None) -> dict[str, Any]:
    """The init fields of a dataclass component, JSON-ready; {} otherwise."""
    if component is None or not dataclasses.is_dataclass(component):
        return {}
    return {
        f.name: _jsonable(getattr(component, f.name))
        for f in dataclasses.fields(component)
        if f.init
    }


def label(component: object | None) -> str:
    """``name(field=value, ...)`` over the fields that differ from their defaults.

    As in scikit-learn's estimator repr, a component at its defaults is just its
    name; ``None`` (the undefended arm) is ``"none"``.
    """
    if component is None:
        return UNDEFENDED
    name = str(getattr(component, "name", type(component).__name__))
    if not dataclasses.is_dataclass(component):
        return name
    changed = []
    for f in dataclasses.fields(component):
        if not f.init:
            continue
        value = getattr(component, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            changed.append(f"{f.name}={_jsonable(value)}")
            continue
        if not _equal(value, default):
            changed.append(f"{f.name}={_jsonable(value)}")
    return f"{name}({', '.join(changed)})" if changed else name


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (ValueError, TypeError):
        return a is b


def _metrics(values: Mapping[str, Any], where: str) -> dict[str, float]:
    out = {}
    for key, value in values.items():
        number = float(value)
        if not np.isfinite(number):
            raise ValueError(f"{where}[{key!r}] is {number}; metrics must be finite")
        out[str(key)] = number
    return out


def run_once(
    scenario: Scenario[Any, Any, Any, Any],
    attack: Any,
    defense: Any | None,
    seed: int,
    meta: Mapping[str, Any] | None = None,
) -> Result:
    """Play one game: set up, (poison,) fit, measure, (attack,) judge, certify.

    Raises
    ------
    ThreatModelViolation
        If ``attack.requires`` holds a capability the scenario's threat model does
        not grant.
    """
    threat = scenario.threat
    threat.require(attack.requires, f"attack {attack.name!r}")
    r_setup, r_fit, r_attack = game_streams(seed)
    with recording() as costs:
        with phase("setup"):
            task = scenario.setup(r_setup)
        if threat.stage is Stage.TRAINING:
            with phase("attack"):
                task = attack.poison(task, r_attack)
        learner = scenario.learner()
        if defense is not None:
            learner = defense.wrap(learner)
        with phase("fit"):
            system = learner.fit(task, r_fit)
        with phase("utility"):
            utility = _metrics(scenario.utility(system, task), "utility")
        guess = None
        if threat.stage is Stage.DEPLOYMENT:
            known = defense if threat.adaptive else None
            view = scenario.expose(system, task, known)
            with phase("attack"):
                guess = attack.run(view, r_attack)
        with phase("judge"):
            success = _metrics(scenario.judge(system, task, guess), "success")
        certificate: dict[str, float] = {}
        if defense is not None and isinstance(defense, Certifiable):
            with phase("certify"):
                certificate = _metrics(defense.certify(system, task), "certificate")
    return Result(
        scenario=scenario.name,
        attack=label(attack),
        defense=label(defense),
        seed=int(seed),
        threat=threat.to_dict(),
        utility=utility,
        success=success,
        cost=dict(costs),
        certificate=certificate,
        params={
            "scenario": params_of(scenario),
            "attack": params_of(attack),
            "defense": params_of(defense),
        },
        meta={**versions(), **(meta or {})},
    )


def evaluate(
    scenario: Scenario[Any, Any, Any, Any],
    attack: Any,
    defenses: Iterable[Any | None],
    seeds: Sequence[int] = (0,),
    meta: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> Iterator[Result]:
    """Run every (seed, arm) pair; ``None`` in ``defenses`` is the undefended arm.

    The capability check runs once up front, so a refused pairing fails before any
    training.
    """
    from tqdm.auto import tqdm

    scenario.threat.require(attack.requires, f"attack {attack.name!r}")
    arms = list(defenses)
    jobs = [(seed, arm) for seed in seeds for arm in arms]
    bar = tqdm(
        jobs, disable=None if progress else True, desc=scenario.name, leave=False
    )
    for seed, arm in bar:
        bar.set_postfix_str(f"seed={seed} {label(arm)}")
        logger.info(
            "run %s / %s / %s seed=%s", scenario.name, label(attack), label(arm), seed
        )
        yield run_once(scenario, attack, arm, seed, meta)


def measurement(
    benchmark: str,
    variant: str,
    seed: int,
    *,
    utility: Mapping[str, float] | None = None,
    success: Mapping[str, float] | None = None,
    cost: Mapping[str, float] | None = None,
    certificate: Mapping[str, float] | None = None,
    params: Mapping[str, Any] | None = None,
    threat: ThreatModel | None = None,
) -> Result:
    """A :class:`Result` for a measurement that is not an attack game.

    ``variant`` plays the role of the defense column (e.g. ``"water_filling"`` or
    ``"cvxpy"``); ``"none"`` marks the reference variant that paired deltas compare
    against. ``threat`` is the threat model the measured system is built against,
    when it has one (security reports print it).
    """
    return Result(
        scenario=benchmark,
        attack="-",
        defense=variant,
        seed=int(seed),
        threat={} if threat is None else threat.to_dict(),
        utility=_metrics(utility or {}, "utility"),
        success=_metrics(success or {}, "success"),
        cost=_metrics(cost or {}, "cost"),
        certificate=_metrics(certificate or {}, "certificate"),
        params={"benchmark": _jsonable(dict(params or {}))},
        meta=versions(),
    )
