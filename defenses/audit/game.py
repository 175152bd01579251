"""One audit's game: the plan of attacks, the set-up of each seed, each run.

For each seed the seed is split with :class:`numpy.random.SeedSequence` into the
set-up, fit and attack streams, exactly as :func:`defenses.harness.run_once` splits
it, and every (attack, arm) run gets fresh copies of them. So the arms of one seed
share everything but the defense (paired deltas), and an audit given the model, the
data and the seeds of a benchmark scenario reproduces that scenario's numbers.

Per run: build the arm from the fit stream, measure utility (test accuracy and the L1
distortion of the answers), expose a :class:`~defenses.oracle.QueryOracle` granted by
the threat model, run the attack with the attack stream, judge the guess. An attack
the threat model does not grant is refused by name before any run; one that runs out
of query budget is refused with the oracle's message, and its partial runs dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm.auto import tqdm

from defenses.arrays import FloatArray, IntArray
from defenses.audit.arms import Answering, Arm
from defenses.audit.attacks import (
    ConfidenceThresholdAttack,
    OfflineLiRA,
    ShadowScores,
    ShadowView,
)
from defenses.audit.config import AuditConfig
from defenses.audit.findings import Curve, Refusal
from defenses.audit.inversion import judge, train_evaluator
from defenses.audit.leakage import membership_success
from defenses.audit.records import (
    AuditData,
    candidates,
)
from defenses.audit.report import AuditReport
from defenses.audit.shadows import train_shadows
from defenses.audit.target import AuditedModel, Outputs
from defenses.cost import phase, recording
from defenses.harness import game_streams, label, params_of, versions
from defenses.metrics import accuracy
from defenses.oracle import QueryBudgetExceeded, QueryOracle
from defenses.reference.attacks import LabelOnlyAttack, LossThresholdAttack
from defenses.results import Result
from defenses.ssd.attacks import InversionView
from defenses.ssd.tasks import Evaluator
from defenses.threat import ThreatModel, ThreatModelViolation

logger = logging.getLogger(__name__)

MEMBERSHIP = "membership"
INVERSION = "inversion"


@dataclass(frozen=True, eq=False)
class Setup:
    """What one seed's set-up stream draws: candidates, shadows, the judge."""

    candidates: FloatArray
    labels: IntArray
    is_member: npt.NDArray[np.bool_]
    shadows: Callable[[np.random.Generator], ShadowScores] | None
    evaluator: Evaluator | None


@dataclass(frozen=True, eq=False)
class AuditJob:
    """One audit's fixed inputs."""

    name: str
    model: AuditedModel
    data: AuditData
    threat: ThreatModel
    config: AuditConfig
    arms: list[Arm]
    private: IntArray | None
    public: FloatArray | None
    bounds: tuple[float, float] | None
    build_model: Callable[[int], Any] | None
    outputs: Outputs
    warnings: tuple[str, ...] = ()
    val_source: str = "given"

    @property
    def targets(self) -> IntArray:
        """The class of each reconstruction (``per_target`` per private class)."""
        assert self.private is not None
        return np.repeat(self.private, self.config.per_target)


def _shadow_bank(
    job: AuditJob, X: FloatArray, y: IntArray
) -> Callable[[np.random.Generator], ShadowScores]:
    """Shadows trained once per key drawn from the attack stream, then reused."""
    trained: dict[int, ShadowScores] = {}
    build = job.build_model
    assert build is not None

    def shadows(rng: np.random.Generator) -> ShadowScores:
        key = int(rng.integers(2**62))
        if key not in trained:
            trained[key] = train_shadows(
                build,
                X,
                y,
                input_shape=job.model.input_shape,
                n_classes=job.data.n_classes,
                classes=job.model.classes,
                outputs=job.outputs,
                config=job.config.shadows,
                rng=np.random.default_rng(key),
            )
        return trained[key]

    return shadows


def _setup(job: AuditJob, seed: int, kinds: set[str], lira: bool) -> Setup:
    rng = game_streams(seed)[0]
    X, y, bits = candidates(job.data, rng)
    evaluator = None
    if INVERSION in kinds and job.public is not None:
        evaluator = train_evaluator(
            job.data.members, job.public, job.data.n_classes, rng
        )
    shadows = _shadow_bank(job, X, y) if lira else None
    return Setup(X, y, bits, shadows, evaluator)


def _utility(system: Answering, job: AuditJob) -> dict[str, float]:
    test = job.data.test
    answers = np.asarray(system.predict_proba(test.X), dtype=np.float64)
    clean = job.model.predict_proba(test.X)
    return {
        "accuracy": accuracy(np.argmax(answers, axis=1), test.y),
        "l1_distortion": float(np.abs(answers - clean).sum(axis=1).mean()),
    }


def _play(
    job: AuditJob, kind: str, attack: Any, arm: Arm, seed: int, setup: Setup
) -> tuple[Result, tuple[FloatArray, FloatArray] | None]:
    _, r_fit, r_attack = game_streams(seed)
    curve = None
    with recording() as costs:
        with phase("fit"):
            system = arm.build(job.model, job.data, r_fit)
        with phase("utility"):
            utility = _utility(system, job)
        oracle = QueryOracle.granted_by(system.predict_proba, job.threat)
        if kind == MEMBERSHIP:
            view: Any = ShadowView(
                oracle, setup.candidates, setup.labels, setup.shadows
            )
        else:
            known = arm.defense if job.threat.adaptive else None
            assert job.public is not None
            view = InversionView(oracle, job.public, job.targets, job.bounds, known)
        with phase("attack"):
            guess = attack.run(view, r_attack)
        with phase("judge"):
            if kind == MEMBERSHIP:
                success, curve = membership_success(
                    guess, setup.is_member, job.config.delta, job.config.confidence
                )
            else:
                assert setup.evaluator is not None
                success = judge(setup.evaluator, guess, job.targets, job.data.n_classes)
    result = Result(
        scenario=job.name,
        attack=label(attack),
        defense=arm.label,
        seed=int(seed),
        threat=job.threat.to_dict(),
        utility=utility,
        success=success,
        cost=dict(costs),
        params={"attack": params_of(attack), "defense": params_of(arm.defense)},
        meta={**versions(), "kind": kind},
    )
    return result, curve


def _plan(job: AuditJob) -> tuple[list[tuple[str, Any]], list[Refusal]]:
    """The attacks to run and the refused ones, each with its reason."""
    cfg = job.config
    candidates_: list[tuple[str, Any]] = [
        (MEMBERSHIP, LossThresholdAttack()),
        (MEMBERSHIP, ConfidenceThresholdAttack()),
        (MEMBERSHIP, LabelOnlyAttack()),
        (MEMBERSHIP, OfflineLiRA()),
    ]
    if job.private is not None:
        candidates_ += [(INVERSION, cfg.brep), (INVERSION, cfg.mirror)]
    plan, refused = [], []
    for kind, attack in candidates_:
        try:
            job.threat.require(attack.requires, f"attack {attack.name!r}")
        except ThreatModelViolation as error:
            refused.append(Refusal(attack.name, str(error)))
            continue
        if isinstance(attack, OfflineLiRA) and job.build_model is None:
            refused.append(
                Refusal(
                    attack.name, "attack 'lira-offline' needs build_model (shadows)"
                )
            )
            continue
        plan.append((kind, attack))
    return plan, refused


def run_audit(job: AuditJob) -> AuditReport:
    """Run every planned attack against every arm at every seed."""
    plan, refusals = _plan(job)
    kinds = {kind for kind, _ in plan}
    lira = any(isinstance(a, OfflineLiRA) for _, a in plan)
    results: list[Result] = []
    curves: list[Curve] = []
    total = len(plan) * len(job.config.seeds) * len(job.arms)
    bar = tqdm(
        total=total, desc=job.name, disable=None if job.config.progress else True
    )
    with bar:
        setups = {}
        for seed in job.config.seeds:
            setups[seed] = _setup(job, seed, kinds, lira)
        for kind, attack in plan:
            mine: list[Result] = []
            mine_curves: list[Curve] = []
            try:
                for seed in job.config.seeds:
                    for arm in job.arms:
                        bar.set_postfix_str(
                            f"{attack.name} / {arm.label} / seed {seed}"
                        )
                        result, curve = _play(
                            job, kind, attack, arm, seed, setups[seed]
                        )
                        mine.append(result)
                        if curve is not None:
                            mine_curves.append(
                                Curve(result.attack, arm.label, seed, *curve)
                            )
                        bar.update(1)
            except QueryBudgetExceeded as error:
                refusals.append(
                    Refusal(attack.name, f"attack {attack.name!r}: {error}")
                )
                logger.info("%s refused: %s", attack.name, error)
                continue
            results += mine
            curves += mine_curves
    return AuditReport(
        name=job.name,
        threat=job.threat,
        results=tuple(results),
        curves=tuple(curves),
        refusals=tuple(refusals),
        warnings=job.warnings,
        data=_describe(job),
        settings={
            "seeds": list(job.config.seeds),
            "delta": job.config.delta,
            "confidence": job.config.confidence,
            "n_shadows": job.config.shadows.n_shadows,
            "per_target": job.config.per_target,
        },
    )


def _describe(job: AuditJob) -> dict[str, Any]:
    data = job.data
    classes = job.model.classes
    private = None
    if job.private is not None:
        names = (
            job.private.tolist() if classes is None else classes[job.private].tolist()
        )
        private = [str(v) for v in names]
    return {
        "members": len(data.members),
        "non_members": len(data.non_members),
        "test": len(data.test),
        "validation": len(data.val),
        "validation_source": job.val_source,
        "n_classes": data.n_classes,
        "input_shape": list(data.input_shape),
        "private_classes": private,
        "public": None if job.public is None else int(job.public.shape[0]),
        "arms": [arm.label for arm in job.arms],
    }
