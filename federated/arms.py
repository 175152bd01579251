r"""The learners: FedAvg without DP, and the DP methods as defenses that wrap it.

* :class:`FedAvgLearner` - FedAvg with non-private local SGD (the undefended system).
* :class:`TimeAdaptiveDP` - the paper's method (Kiani et al., ICLR 2025): individual
  budgets, save-then-spend sampling rates (optionally only the strictest group saves).
* :class:`IDPFedAvg` - individual budgets spent uniformly over time.
* :class:`DPFedAvg` - everyone held to the strictest budget, uniform spending.
* :class:`FlowerCentralDP` - Flower's server-side fixed-clipping wrapper
  (``DifferentialPrivacyServerSideFixedClipping``, Andrew/McMahan et al. 2018):
  client-level central DP, each client update clipped to :math:`C_u`, Gaussian noise
  :math:`\mathcal N(0, (\sigma C_u / m)^2)` on the mean, with :math:`\sigma` solved
  so that :math:`T` releases spend the strictest budget at client level.

Every DP method plans all schedules before training, so a budget that cannot be met
fails before any update, and certifies the epsilon each client *actually* spent,
recomputed from the history the loop recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from defenses.api import DefenseKind
from defenses.checks import check_choice, check_real

from .accounting import (
    ACCOUNTANTS,
    Accountant,
    check_budget,
    check_delta,
    epsilon,
    solve_noise_multiplier,
)
from .client import Params, StepPlan
from .postprocess import lr_scales, noise_weights
from .schedule import (
    ClientSchedule,
    Policy,
    StrictOnly,
    TimeAdaptive,
    Uniform,
    plan_schedules,
)
from .training import FedConfig, FederatedData, FederatedModel, run_federated


class BudgetedTask(Protocol):
    """What the DP methods need from a task: data, per-client budgets, delta."""

    @property
    def data(self) -> FederatedData:
        """The clients' data."""
        ...

    @property
    def budgets(self) -> tuple[float, ...]:
        """Epsilon budget of each client."""
        ...

    @property
    def delta(self) -> float:
        """Target delta."""
        ...


def check_task_budgets(task: BudgetedTask) -> None:
    """Raise ValueError for a task whose budgets or delta are invalid."""
    check_delta(task.delta)
    if len(task.budgets) != len(task.data.clients):
        raise ValueError(
            f"{len(task.budgets)} budgets for {len(task.data.clients)} clients"
        )
    for i, b in enumerate(task.budgets):
        check_budget(b, f"budgets[{i}]")


@dataclass(frozen=True)
class FedAvgLearner:
    """FedAvg with non-private local SGD at ``config.batch_rate`` (no DP)."""

    config: FedConfig = field(default_factory=FedConfig)
    progress: bool = False

    def fit(self, task: BudgetedTask, rng: np.random.Generator) -> FederatedModel:
        """Train the global model."""
        cfg = self.config
        plan = StepPlan(cfg.batch_rate, cfg.local_steps, None)
        return run_federated(
            task.data, lambda n, t: plan, cfg, rng, progress=self.progress
        )


def realised_certificate(
    system: FederatedModel, task: BudgetedTask, accountant: Accountant
) -> dict[str, float]:
    """Epsilon each client actually spent (RDP and PRV) against its budget.

    Keys: ``eps_max``, ``eps_min``, ``eps_strict`` (mean over the strictest
    clients), ``eps_prv_max``, ``spent_ratio_max`` and ``spent_ratio_min``
    (realised epsilon over budget; the target is [0.99, 1]).
    """
    eps = [epsilon(h, task.delta, accountant) for h in system.histories]
    prv = [epsilon(h, task.delta, "prv") for h in system.histories]
    ratios = [e / b for e, b in zip(eps, task.budgets, strict=True)]
    strict = min(task.budgets)
    return {
        "eps_max": max(eps),
        "eps_min": min(eps),
        "eps_strict": float(
            np.mean([e for e, b in zip(eps, task.budgets, strict=True) if b == strict])
        ),
        "eps_prv_max": max(prv),
        "spent_ratio_max": max(ratios),
        "spent_ratio_min": min(ratios),
    }


@dataclass(frozen=True)
class ScheduledLearner:
    """FedAvg whose clients run local DP-SGD on per-client schedules."""

    inner: FedAvgLearner
    method: DPSGDMethod

    def schedules(self, task: BudgetedTask) -> list[ClientSchedule]:
        """Solve every client's schedule (before any training)."""
        check_task_budgets(task)
        cfg = self.inner.config
        return plan_schedules(
            self.method.client_budgets(task),
            self.method.policy(),
            delta=task.delta,
            rounds=cfg.rounds,
            steps=cfg.local_steps,
            sigma=self.method.sigma,
            accountant=self.method.accountant,
        )

    def fit(self, task: BudgetedTask, rng: np.random.Generator) -> FederatedModel:
        """Plan, then train with each client's per-round rate.

        With the method's ``lr_follows_batch`` and ``noise_weighted`` options the
        learning rate and the aggregation weights follow the plans
        (:func:`lr_scales`, :func:`noise_weights`); both are functions of the public
        schedules only, i.e. post-processing of the DP releases.
        """
        plans = self.schedules(task)

        def plan(n: int, t: int) -> StepPlan:
            r = plans[n].rounds[t]
            return StepPlan(r.rate, r.steps, r.sigma)

        scales = lr_scales(plans) if self.method.lr_follows_batch else None
        sizes = [len(c) for c in task.data.clients]
        weights = (
            noise_weights(plans, sizes, scales) if self.method.noise_weighted else None
        )
        model = run_federated(
            task.data,
            plan,
            self.inner.config,
            rng,
            progress=self.inner.progress,
            lr_scale=None if scales is None else (lambda n, t: scales[n][t]),
            weights=None if weights is None else (lambda t: weights[t]),
        )
        model.unit = "record"
        return model


class DPSGDMethod:
    """What the DP-SGD trainers share.

    Checked parameters, the wrapping into a :class:`ScheduledLearner`, and the
    realised certificate. Each subclass is a frozen dataclass declaring the fields
    below (in its own order: a label names them in field order) and its
    :meth:`policy` (how a client spends its budget over the rounds).

    Parameters
    ----------
    sigma : float
        Noise multiplier shared by all clients and rounds, > 0.
    accountant : {"rdp", "prv"}
        Accountant used to calibrate and certify.
    lr_follows_batch : bool
        Scale each round's learning rate by its rate over the plan's mean rate
        (:func:`lr_scales`).
    noise_weighted : bool
        Weight the aggregate by each update's inverse noise variance
        (:func:`noise_weights`) instead of by data size.
    """

    kind: ClassVar[DefenseKind] = DefenseKind.TRAINER
    sigma: float
    accountant: Accountant
    lr_follows_batch: bool
    noise_weighted: bool

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_real(f"{owner}.sigma", self.sigma, 0.0, open_low=True)
        check_choice(f"{owner}.accountant", self.accountant, ACCOUNTANTS)
        for name in ("lr_follows_batch", "noise_weighted"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{owner}.{name} must be true or false, got {getattr(self, name)!r}"
                )

    def policy(self) -> Policy:
        """How each client spends its budget over the rounds."""
        raise NotImplementedError

    def client_budgets(self, task: BudgetedTask) -> list[float]:
        """The budget each client's schedule spends (its own, by default)."""
        return list(task.budgets)

    def wrap(self, learner: FedAvgLearner) -> ScheduledLearner:
        """Return the learner whose clients run DP-SGD on this method's schedules."""
        return ScheduledLearner(learner, self)

    def certify(self, system: FederatedModel, task: BudgetedTask) -> dict[str, float]:
        """Realised per-client epsilon against the budgets."""
        return realised_certificate(system, task, self.accountant)


@dataclass(frozen=True)
class TimeAdaptiveDP(DPSGDMethod):
    """Time-adaptive privacy spending: save early, spend later (Kiani et al., 2025).

    The parameters are :class:`DPSGDMethod`'s and the saving phase's:

    Parameters
    ----------
    save_fraction : float
        Fraction of rounds in the saving phase, in (0, 1).
    save_ratio : float
        Saving rate as a fraction of the client's uniform rate, in (0, 1].
    strict_only : bool
        Only the strictest privacy group saves; the others spend uniformly.
    """

    name: ClassVar[str] = "federated-time-adaptive"
    sigma: float = 1.0
    save_fraction: float = 0.5
    save_ratio: float = 0.7
    strict_only: bool = False
    accountant: Accountant = "rdp"
    lr_follows_batch: bool = False
    noise_weighted: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.policy()

    def policy(self) -> Policy:
        """The schedule policy (validates the saving parameters)."""
        cls = StrictOnly if self.strict_only else TimeAdaptive
        return cls(self.save_fraction, self.save_ratio)


@dataclass(frozen=True)
class IDPFedAvg(DPSGDMethod):
    """Individual budgets, each spent uniformly over the rounds (IDP-FedAvg).

    The parameters are :class:`DPSGDMethod`'s; a uniform plan has one rate, so
    ``lr_follows_batch`` leaves the learning rate as it is.
    """

    name: ClassVar[str] = "federated-idp-fedavg"
    sigma: float = 1.0
    accountant: Accountant = "rdp"
    lr_follows_batch: bool = False
    noise_weighted: bool = False

    def policy(self) -> Policy:
        """Uniform spending."""
        return Uniform()


@dataclass(frozen=True)
class DPFedAvg(IDPFedAvg):
    """Every client held to the strictest budget, spent uniformly (DP-FedAvg).

    The parameters are :class:`IDPFedAvg`'s.
    """

    name: ClassVar[str] = "federated-dp-fedavg"

    def client_budgets(self, task: BudgetedTask) -> list[float]:
        """The strictest budget, for every client."""
        return [min(task.budgets)] * len(task.budgets)

    def certify(self, system: FederatedModel, task: BudgetedTask) -> dict[str, float]:
        """Realised epsilon (all clients at the strictest budget)."""
        strict = min(task.budgets)
        eps = [epsilon(h, task.delta, self.accountant) for h in system.histories]
        return {
            "eps_max": max(eps),
            "eps_min": min(eps),
            "eps_strict": max(eps),
            "eps_prv_max": max(epsilon(h, task.delta, "prv") for h in system.histories),
            "spent_ratio_max": max(eps) / strict,
            "spent_ratio_min": min(eps) / strict,
        }


def central_noise_multiplier(budget: float, delta: float, releases: int) -> float:
    """Sigma for ``releases`` Gaussian releases (no subsampling) spending ``budget``.

    Solved with the same Opacus RDP accountant that certifies it, so the certified
    epsilon lies in [0.995, 1] x budget.
    """
    return solve_noise_multiplier(budget, delta, 1.0, releases)


@dataclass(frozen=True)
class CentralDPLearner:
    """FedAvg with Flower's server-side fixed clipping and central Gaussian noise."""

    inner: FedAvgLearner
    method: FlowerCentralDP

    def fit(self, task: BudgetedTask, rng: np.random.Generator) -> FederatedModel:
        """Non-private local SGD; clipped, noised aggregation on the server."""
        from flwr.supercore.differential_privacy import (
            compute_clip_model_update,
            compute_stdv,
        )

        check_task_budgets(task)
        cfg = self.inner.config
        m = len(task.data.clients)
        sigma = central_noise_multiplier(min(task.budgets), task.delta, cfg.rounds)
        clip = self.method.clipping_norm

        def aggregate(
            base: Params,
            updates: list[Params],
            sizes: Sequence[float],
            r: np.random.Generator,
        ) -> Params:
            clipped = []
            for update in updates:
                new = [u.copy() for u in update]
                compute_clip_model_update(new, base, clip)
                clipped.append(new)
            std = compute_stdv(sigma, clip, m)
            return [
                np.mean([c[i] for c in clipped], axis=0)
                + r.normal(0.0, std, base[i].shape)
                for i in range(len(base))
            ]

        plan = StepPlan(cfg.batch_rate, cfg.local_steps, None)
        model = run_federated(
            task.data,
            lambda n, t: plan,
            cfg,
            rng,
            aggregate,
            progress=self.inner.progress,
        )
        model.histories = [[(sigma, 1.0, cfg.rounds)] for _ in task.data.clients]
        model.unit = "client"
        return model


@dataclass(frozen=True)
class FlowerCentralDP:
    """Flower's built-in DP wrapper (server-side fixed clipping), client-level DP.

    Parameters
    ----------
    clipping_norm : float
        Clip norm of each client's model update, > 0.
    """

    name: ClassVar[str] = "federated-flower-dp"
    kind: ClassVar[DefenseKind] = DefenseKind.TRAINER
    clipping_norm: float = 1.0

    def __post_init__(self) -> None:
        check_real(
            "FlowerCentralDP.clipping_norm", self.clipping_norm, 0.0, open_low=True
        )

    def wrap(self, learner: FedAvgLearner) -> CentralDPLearner:
        """Return the learner with central DP aggregation."""
        return CentralDPLearner(learner, self)

    def certify(self, system: FederatedModel, task: BudgetedTask) -> dict[str, float]:
        """Client-level epsilon of the releases (a different unit than record level)."""
        eps = epsilon(system.histories[0], task.delta, "rdp")
        strict = min(task.budgets)
        return {
            "eps_max": eps,
            "eps_min": eps,
            "eps_strict": eps,
            "eps_prv_max": epsilon(system.histories[0], task.delta, "prv"),
            "spent_ratio_max": eps / strict,
            "spent_ratio_min": eps / strict,
        }
