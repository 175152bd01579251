"""Harness wiring of the time-adaptive DP federated-learning package.

Two games share one federated task (:mod:`federated.tasks`) and learner (FedAvg
without DP; the DP methods of :mod:`federated.arms` wrap it):

* ``federated-audit`` - the canary audit of the strictest client's accountant by an
  observer of its updates (:mod:`federated.audit`); success is the epsilon lower
  bound, to be read next to the certified epsilon;
* ``federated-membership`` - loss-threshold membership inference on the final
  global model, AUC overall and per privacy group.

Utility is the test accuracy of the global model: after the last round, averaged
over the last five rounds, and after every round (``acc@<t>``) for the curves.
Importing this module registers every scenario, attack, defense, measurement
benchmark and figure of the package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_int
from defenses.fields import owner_key, values_of
from defenses.metrics import membership_metrics
from defenses.reference.membership import Members, MembershipRules
from defenses.registry import register, register_package
from defenses.threat import Capability, Goal, Knowledge, ThreatModel

from . import benchmark, figures
from .arms import (
    DPFedAvg,
    FedAvgLearner,
    FlowerCentralDP,
    IDPFedAvg,
    TimeAdaptiveDP,
)
from .attacks import AuditView, CanaryObserver, GlobalModelMIA
from .audit import inclusion_profile, lower_bound, observe_canary
from .client import SAMPLINGS
from .tasks import FederatedTask, TaskFields
from .training import FedConfig, FederatedModel, TrainingFields

register_package(
    attacks=[CanaryObserver, GlobalModelMIA],
    defenses=[TimeAdaptiveDP, IDPFedAvg, DPFedAvg, FlowerCentralDP],
    benchmarks={
        "federated-audit-controls": benchmark.audit_controls,
        "federated-flower": benchmark.flower_side_by_side,
    },
    figures={"federated": figures.figures},
)


@dataclass(frozen=True)
class FederatedGame(TrainingFields, TaskFields):
    """The federated task and learner shared by both games.

    Parameters
    ----------
    dataset, n_clients, alpha, budgets, group_fractions, delta, member_fraction
        The task (:class:`federated.tasks.TaskFields`); ``n_clients`` >= 2.
    rounds, local_steps, lr, clip, model, hidden, batch_rate
        The training (:class:`federated.training.TrainingFields`).
    audit_trials : int
        Canary trials of the audit game, >= 100.
    """

    audit_trials: int = 2000

    def __post_init__(self) -> None:
        key = owner_key(self)
        self.check_task_fields(key, min_clients=2)
        self.check_training_fields(key)
        check_int(key("audit_trials"), self.audit_trials, minimum=100)

    def config(self) -> FedConfig:
        """The federated-training hyper-parameters."""
        return FedConfig(**values_of(TrainingFields, self))

    def setup(self, rng: np.random.Generator) -> FederatedTask:
        """Split the data across clients; draw groups and membership candidates."""
        return self.task(self.n_clients, rng)

    def learner(self) -> FedAvgLearner:
        """The undefended system: FedAvg with non-private local SGD."""
        return FedAvgLearner(self.config())

    def utility(self, system: FederatedModel, task: FederatedTask) -> dict[str, float]:
        """Test accuracy (final, last five rounds, curve) and accuracy per group.

        ``accuracy_<group>`` is the final model's accuracy on the held-out records
        of that privacy group's clients (the non-member candidates, drawn from each
        client's own non-IID distribution and never trained on): what the group
        itself gets from the global model.
        """
        curve = system.curve
        out = {
            "accuracy": curve[-1],
            "accuracy_last5": float(np.mean(curve[-5:])),
            "accuracy_auc": float(np.mean(curve)),
        }
        held = ~task.is_member
        predicted = np.argmax(system.predict_proba(task.candidates), axis=1)
        correct = predicted == task.candidate_labels
        for group in dict.fromkeys(task.groups):
            mask = held & (task.candidate_groups == group)
            if mask.any():
                out[f"accuracy_{group}"] = float(np.mean(correct[mask]))
        out.update({f"acc@{t + 1}": a for t, a in enumerate(curve)})
        return out


@register("scenarios", "federated-audit")
@dataclass(frozen=True)
class FederatedAudit(FederatedGame):
    """Canary audit of the strictest client by an observer of its updates."""

    name: ClassVar[str] = "federated-audit"
    headline: ClassVar[tuple[str, str]] = ("accuracy", "eps_lb")
    chance: ClassVar[Mapping[str, float]] = {"eps_lb": 0.0}

    @property
    def threat(self) -> ThreatModel:
        """A gray-box observer of client-to-server traffic."""
        return ThreatModel.granting(
            Goal.CONFIDENTIALITY,
            Capability.OBSERVE_TRAFFIC,
            knowledge=Knowledge.GRAY_BOX,
        )

    def _canary_in(self, task: FederatedTask) -> npt.NDArray[np.bool_]:
        coins = np.random.default_rng([task.seed, 1]).random(self.audit_trials) < 0.5
        return coins

    def expose(
        self, system: FederatedModel, task: FederatedTask, known_defense: object | None
    ) -> AuditView:
        """Replay client 0's rounds with and without the canary; project releases."""
        rng = np.random.default_rng([task.seed, 2])
        plans = system.plans[0]
        n = len(task.data.clients[0])
        sampling = SAMPLINGS[0]
        observations = observe_canary(plans, self._canary_in(task), n, sampling, rng)
        return AuditView(
            observations=observations,
            rates=tuple(p.rate for p in plans for _ in range(p.steps)),
            sigmas=tuple(p.sigma for p in plans for _ in range(p.steps)),
            profile=inclusion_profile(plans, n, sampling, rng),
        )

    def judge(
        self, system: FederatedModel, task: FederatedTask, guess: Any | None
    ) -> dict[str, float]:
        """Epsilon lower bound at the task's delta from the observer's scores."""
        if guess is None:
            raise ValueError("the audit game needs the observer's scores")
        rng = np.random.default_rng([task.seed, 3])
        return {"eps_lb": lower_bound(guess, self._canary_in(task), task.delta, rng)}

    def random_guess(self, task: FederatedTask, rng: np.random.Generator) -> FloatArray:
        """Scores that ignore the observations."""
        return rng.random(self.audit_trials)


@register("scenarios", "federated-membership")
@dataclass(frozen=True)
class FederatedMembership(
    MembershipRules[FederatedModel, FederatedTask], FederatedGame
):
    """Loss-threshold membership inference on the global model, per privacy group."""

    name: ClassVar[str] = "federated-membership"
    headline: ClassVar[tuple[str, str]] = ("accuracy", "auc")
    chance: ClassVar[Mapping[str, float]] = {"auc": 0.5, "advantage": 0.0}

    @property
    def threat(self) -> ThreatModel:
        """Black-box scores of the deployed global model."""
        return ThreatModel.granting(Goal.CONFIDENTIALITY, Capability.QUERY_SCORES)

    def membership(self, task: FederatedTask) -> Members:
        """Every client's members and held-out records, with their labels."""
        return Members(task.candidates, task.candidate_labels, task.is_member)

    def judge(
        self, system: FederatedModel, task: FederatedTask, guess: FloatArray | None
    ) -> dict[str, float]:
        """Membership AUC, advantage, TPR at low FPR; AUC per privacy group."""
        out = super().judge(system, task, guess)
        scores = np.asarray(guess, dtype=np.float64)
        for group in dict.fromkeys(task.groups):
            mask = task.candidate_groups == group
            truth = task.is_member[mask]
            if truth.any() and not truth.all():
                out[f"auc_{group}"] = membership_metrics(scores[mask], truth)["auc"]
        return out
