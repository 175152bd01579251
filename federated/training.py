r"""The framework-free federated loop: FedAvg over clients running local (DP-)SGD.

Round :math:`t`: every client :math:`n` starts from the global weights
:math:`w_t`, runs its round plan (:class:`federated.client.StepPlan`) and returns
:math:`w_t^n`; the server sets
:math:`w_{t+1} = \sum_n \frac{|D_n|}{\sum_m |D_m|} w_t^n` (McMahan et al., 2017), or
hands the updates to a custom aggregator (central DP). Each client draws from its own
random stream, spawned once from the run's generator, so a run is reproducible bit
for bit and the Flower app (:mod:`federated.flower.app`) can replay the same client
step.
The loop records what each client actually ran (its accountant history) and the test
accuracy after every round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_choice, check_int, check_real
from defenses.fields import Key, owner_key

from .accounting import Phase, merge
from .client import (
    MODELS,
    SAMPLINGS,
    LocalData,
    Model,
    Params,
    Sampling,
    StepPlan,
    init_params,
    local_train_clients,
    predict_proba,
)

Aggregator = Callable[
    [Params, list[Params], Sequence[float], np.random.Generator], Params
]
PlanFn = Callable[[int, int], StepPlan]
LrFn = Callable[[int, int], float]
WeightFn = Callable[[int], Sequence[float]]


@dataclass(frozen=True)
class TrainingFields:
    """Hyper-parameters of federated training.

    The harness game (:class:`federated.scenario.FederatedGame`), the Flower app's
    :class:`federated.flower.config.AppConfig` and :class:`FedConfig` inherit them.

    Parameters
    ----------
    rounds : int
        Federated rounds T >= 1.
    local_steps : int
        Local SGD steps K per round, >= 1.
    lr : float
        Local learning rate, > 0.
    clip : float
        Per-example clip norm C, > 0.
    model : {"softmax", "mlp"}
        Multinomial logistic regression (numpy) or a one-hidden-layer MLP (Opacus).
    hidden : int
        Hidden width of the MLP, >= 1.
    batch_rate : float
        Sampling rate of non-private local SGD, in (0, 1].
    """

    rounds: int = 30
    local_steps: int = 4
    lr: float = 0.5
    clip: float = 1.0
    model: str = "softmax"
    hidden: int = 32
    batch_rate: float = 0.1

    def check_training_fields(self, key: Key) -> None:
        """Raise ValueError, naming a field by ``key``, unless every field is valid."""
        check_choice(key("model"), self.model, MODELS)
        for name in ("rounds", "local_steps", "hidden"):
            check_int(key(name), getattr(self, name), 1)
        for name in ("lr", "clip"):
            check_real(key(name), getattr(self, name), 0.0, open_low=True)
        check_real(key("batch_rate"), self.batch_rate, 0.0, 1.0, open_low=True)


@dataclass(frozen=True)
class FedConfig(TrainingFields):
    """The training hyper-parameters (:class:`TrainingFields`) and the sampling.

    Parameters
    ----------
    sampling : {"poisson", "fixed"}
        Batch sampling of the clients ("fixed" is the audit's negative control).
    """

    model: Model = "softmax"
    sampling: Sampling = "poisson"

    def __post_init__(self) -> None:
        self.check_training_fields(owner_key(self))
        check_choice("FedConfig.sampling", self.sampling, SAMPLINGS)


@dataclass(frozen=True)
class FederatedData:
    """The clients' local data and a held-out test set."""

    clients: tuple[LocalData, ...]
    test_X: FloatArray
    test_y: IntArray
    n_classes: int

    def __post_init__(self) -> None:
        if not self.clients:
            raise ValueError("federated data needs at least one client")
        dims = {c.X.shape[1] for c in self.clients}
        if len(dims) != 1 or self.test_X.shape[1:] != (dims.pop(),):
            raise ValueError("all clients and the test set must share one feature dim")
        if self.test_y.shape != (self.test_X.shape[0],) or self.test_y.size == 0:
            raise ValueError("the test set must be non-empty with one label per row")

    @property
    def dim(self) -> int:
        """Feature dimension."""
        return int(self.test_X.shape[1])


@dataclass
class FederatedModel:
    """The trained global model and what training recorded.

    Its test-accuracy curve, each client's accountant history (DP steps only) and
    per-round plans, and the privacy unit ("none", "record" or "client").
    """

    params: Params
    curve: list[float]
    histories: list[list[Phase]] = field(default_factory=list)
    plans: list[list[StepPlan]] = field(default_factory=list)
    unit: str = "none"

    def predict_proba(self, X: FloatArray) -> FloatArray:
        """Class probabilities of the global model."""
        return predict_proba(self.params, np.asarray(X, dtype=np.float64))


def fedavg(
    base: Params,
    updates: list[Params],
    weights: Sequence[float],
    rng: np.random.Generator,
) -> Params:
    """Weighted average of the clients' weights (FedAvg: weights = data sizes)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(updates),) or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(
            f"need one finite weight >= 0 per update ({len(updates)}), got {weights!r}"
        )
    if w.sum() <= 0:
        raise ValueError(f"aggregation weights sum to 0: {weights!r}")
    w = w / w.sum()
    return [
        np.sum([wi * u[i] for wi, u in zip(w, updates, strict=True)], axis=0)
        for i in range(len(base))
    ]


def accuracy_of(params: Sequence[FloatArray], X: FloatArray, y: IntArray) -> float:
    """Top-1 accuracy of ``params`` on (X, y)."""
    return float(np.mean(np.argmax(predict_proba(params, X), axis=1) == y))


def run_federated(
    data: FederatedData,
    plan: PlanFn,
    config: FedConfig,
    rng: np.random.Generator,
    aggregate: Aggregator = fedavg,
    progress: bool = True,
    lr_scale: LrFn | None = None,
    weights: WeightFn | None = None,
) -> FederatedModel:
    """Train with full participation; ``plan(client, round)`` gives each round's plan.

    ``lr_scale(client, round)`` multiplies ``config.lr`` for that client's round
    (default 1); ``weights(round)`` gives the aggregation weight of each client
    (default its data size, FedAvg). Both must depend on public quantities only
    (the plans), never on the data, so they are post-processing of the DP releases.
    Every plan is built before training starts, so a client whose plan is invalid
    fails the run before any update is computed.
    """
    plans = [
        [plan(n, t) for t in range(config.rounds)] for n in range(len(data.clients))
    ]
    scales = [
        [1.0 if lr_scale is None else lr_scale(n, t) for t in range(config.rounds)]
        for n in range(len(data.clients))
    ]
    init_rng, server_rng, *client_rngs = (
        np.random.default_rng(s)
        for s in np.random.SeedSequence(int(rng.integers(2**63 - 1))).spawn(
            2 + len(data.clients)
        )
    )
    params = init_params(
        config.model, data.dim, data.n_classes, config.hidden, init_rng
    )
    histories: list[list[Phase]] = [[] for _ in data.clients]
    curve: list[float] = []
    sizes = [len(c) for c in data.clients]
    bar = tqdm(range(config.rounds), disable=None if progress else True, leave=False)
    for t in bar:
        steps = [plans[n][t] for n in range(len(data.clients))]
        updates = local_train_clients(
            params,
            data.clients,
            steps,
            lrs=[config.lr * scales[n][t] for n in range(len(data.clients))],
            clip=config.clip,
            rngs=client_rngs,
            sampling=config.sampling,
        )  # in process: no one times the replies (constant_work=False)
        for n, step in enumerate(steps):
            if step.sigma is not None:
                histories[n] = merge(
                    [*histories[n], (step.sigma, step.rate, step.steps)]
                )
        params = aggregate(
            params, updates, sizes if weights is None else weights(t), server_rng
        )
        curve.append(accuracy_of(params, data.test_X, data.test_y))
    return FederatedModel(params, curve, histories, plans)
