"""Deterministic, isolated training of one classifier per hash part.

The training certificate of RPS assumes that an unchanged part yields an identical
classifier (Scholten & Günnemann, ICLR 2025, Sec. on training isolation). This
module enforces it:

* each part is trained on its own rows only, in canonical (label, features) order;
* a scikit-learn estimator is cloned per part and, if it has a ``random_state``
  parameter, gets the seed ``random_state * 7919 + part`` (per-part normalisation
  comes for free with a ``Pipeline`` holding a scaler);
* a torch model factory is trained full-batch by :class:`TorchPartClassifier` with
  its own ``torch.Generator`` and one thread;
* a part holding a single class becomes a constant predictor;
* a part whose training fails raises :class:`PartTrainingError` naming it (it is
  never dropped silently).

Parts train in parallel (joblib) when ``n_jobs`` allows; the result does not depend
on ``n_jobs``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from joblib import Parallel, delayed  # type: ignore[import-untyped]
from sklearn.base import BaseEstimator, clone
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from defenses.checks import check_real
from defenses.rps.partition import IntArray, partition
from defenses.rps.scores import vote_counts

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
ModelFactory = Callable[[int, int], "torch.nn.Module"]


class PartTrainingError(RuntimeError):
    """A part's classifier could not be trained."""


@runtime_checkable
class PartClassifier(Protocol):
    """What a part's classifier offers once fitted: labels in ``0..K-1``."""

    def predict(self, X: FloatArray) -> npt.NDArray[Any]:
        """Predicted (encoded) labels of shape (n,)."""
        ...


@runtime_checkable
class PartVoter(Protocol):
    """Part classifiers trained elsewhere, seen as one vote per part and point.

    For :meth:`ReliableConformalClassifier.from_voter
    <defenses.rps.defense.ReliableConformalClassifier.from_voter>`. The training
    certificate holds when each training point (poisoned or not) can influence at
    most one part, e.g. parts formed by a hash of each sample or of its id.

    Attributes
    ----------
    n_parts : int
        ``k_t``, fixed for the life of the ensemble (a part left without data
        abstains instead of disappearing).
    """

    n_parts: int

    def part_votes(self, X: FloatArray) -> IntArray:
        """Class index ``0..K-1`` per part and point, or -1 (abstain).

        Returns an integer array of shape ``(n_parts, n)``.
        """
        ...


@dataclass(frozen=True)
class ConstantClassifier:
    """Predicts one class everywhere (a part that holds a single class)."""

    label: int

    def predict(self, X: FloatArray) -> IntArray:
        """The constant label for each row."""
        return np.full(X.shape[0], self.label, dtype=np.int64)


class TorchPartClassifier:
    """Full-batch, deterministic training of a torch model built by a factory.

    Parameters
    ----------
    factory : callable
        ``factory(n_features, n_classes)`` returns an untrained ``torch.nn.Module``
        mapping (n, d) float32 inputs to (n, K) logits.
    epochs : int
        Full-batch Adam steps.
    lr : float
        Adam learning rate.
    seed : int
        Seed of the part's ``torch.Generator`` (initialisation).
    """

    def __init__(
        self, factory: ModelFactory, epochs: int = 200, lr: float = 0.01, seed: int = 0
    ) -> None:
        if not callable(factory):
            raise ValueError(f"factory must be callable, got {factory!r}")
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        check_real("lr", lr, 0.0, open_low=True)
        self.factory = factory
        self.epochs = epochs
        self.lr = lr
        self.seed = seed
        self.model_: torch.nn.Module | None = None

    def fresh(self, seed: int) -> TorchPartClassifier:
        """An unfitted copy with another seed."""
        return TorchPartClassifier(self.factory, self.epochs, self.lr, seed)

    def fit(
        self, X: FloatArray, y: npt.NDArray[np.integer], n_classes: int
    ) -> TorchPartClassifier:
        """Train on (X, y) with one thread and a seeded generator."""
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            generator = torch.Generator().manual_seed(self.seed)
            model = self.factory(X.shape[1], n_classes)
            with torch.no_grad():
                for p in model.parameters():
                    bound = 1.0 / max(1, p.shape[-1]) ** 0.5
                    p.copy_(
                        torch.rand(p.shape, generator=generator) * 2 * bound - bound
                    )
            inputs = torch.as_tensor(X, dtype=torch.float32)
            targets = torch.as_tensor(np.asarray(y), dtype=torch.int64)
            optimizer = torch.optim.Adam(model.parameters(), lr=self.lr)
            loss_fn = torch.nn.CrossEntropyLoss()
            for _ in range(self.epochs):
                optimizer.zero_grad()
                loss = loss_fn(model(inputs), targets)
                loss.backward()
                optimizer.step()
            self.model_ = model.eval()
        finally:
            torch.set_num_threads(threads)
        return self

    def predict(self, X: FloatArray) -> IntArray:
        """Arg-max of the logits."""
        if self.model_ is None:
            raise RuntimeError("TorchPartClassifier is not fitted")
        import torch

        with torch.no_grad():
            logits = self.model_(torch.as_tensor(X, dtype=torch.float32))
        return np.asarray(logits.argmax(dim=1).numpy(), dtype=np.int64)


def _fresh(estimator: Any, part: int, random_state: int) -> Any:
    seed = random_state * 7919 + part
    if isinstance(estimator, TorchPartClassifier):
        return estimator.fresh(seed)
    if isinstance(estimator, BaseEstimator):
        model = clone(estimator)
        if "random_state" in model.get_params():
            model.set_params(random_state=seed)
        return model
    if callable(estimator):
        return TorchPartClassifier(estimator, seed=seed)
    raise ValueError(
        "estimator must be a scikit-learn classifier, a TorchPartClassifier or a "
        f"torch model factory (n_features, n_classes) -> Module, got {estimator!r}"
    )


def check_estimator(estimator: Any) -> None:
    """Raise ValueError unless ``estimator`` is a usable base learner."""
    _fresh(estimator, 0, 0)
    if isinstance(estimator, BaseEstimator) and not hasattr(estimator, "predict"):
        raise ValueError(f"estimator {estimator!r} has no predict method")


def train_part(
    estimator: Any,
    X: FloatArray,
    y: IntArray,
    n_classes: int,
    part: int,
    random_state: int,
) -> PartClassifier:
    """Train one part (rows already in canonical order)."""
    classes = np.unique(y)
    if classes.size == 1:
        logger.info("part %d holds only class %d: constant predictor", part, classes[0])
        return ConstantClassifier(int(classes[0]))
    model = _fresh(estimator, part, random_state)
    try:
        with threadpool_limits(limits=1):
            if isinstance(model, TorchPartClassifier):
                fitted: PartClassifier = model.fit(X, y, n_classes)
            else:
                fitted = model.fit(X, y)
    except Exception as error:
        raise PartTrainingError(
            f"training part {part} failed ({X.shape[0]} samples, classes "
            f"{classes.tolist()}): {type(error).__name__}: {error}"
        ) from error
    return fitted


def train_parts(
    estimator: Any,
    X: FloatArray,
    y: IntArray,
    n_parts: int,
    n_classes: int,
    random_state: int = 0,
    n_jobs: int | None = None,
) -> tuple[list[PartClassifier], list[IntArray]]:
    """Hash-partition (X, y) and train one classifier per part.

    Returns the fitted classifiers and each part's row indices.
    """
    parts = partition(X, y, n_parts)
    jobs = [
        delayed(train_part)(estimator, X[p], y[p], n_classes, i, random_state)
        for i, p in enumerate(parts)
    ]
    if n_jobs == 1 or n_parts == 1:
        models = [job[0](*job[1], **job[2]) for job in jobs]
    else:
        models = list(Parallel(n_jobs=n_jobs)(jobs))
    return models, parts


def predict_parts(models: Sequence[PartClassifier], X: FloatArray) -> IntArray:
    """Predictions of every part, shape (k_t, n)."""
    return np.stack([np.asarray(m.predict(X), dtype=np.int64) for m in models])


def proba_columns(model: Any, X: FloatArray, n_classes: int) -> FloatArray:
    """``predict_proba`` of a single model, spread over all ``n_classes`` columns."""
    if not hasattr(model, "predict_proba"):
        labels = np.asarray(model.predict(X), dtype=np.int64)
        out = np.zeros((X.shape[0], n_classes))
        out[np.arange(X.shape[0]), labels] = 1.0
        return out
    proba = np.asarray(model.predict_proba(X), dtype=np.float64)
    known = np.asarray(
        getattr(model, "classes_", np.arange(proba.shape[1])), dtype=np.int64
    )
    out = np.zeros((X.shape[0], n_classes))
    out[:, known] = proba
    return out


def voter_votes(
    voter: PartVoter, features: FloatArray, n_parts: int, n_classes: int
) -> IntArray:
    """Vote counts (n, K) of a :class:`PartVoter`, checked against its contract."""
    if voter.n_parts != n_parts:
        raise ValueError(
            f"voter.n_parts changed from {n_parts} to {voter.n_parts}: it must "
            "stay fixed for the life of the ensemble (a part without data "
            "abstains)"
        )
    votes = np.asarray(voter.part_votes(features))
    if votes.shape != (n_parts, features.shape[0]):
        raise ValueError(
            f"voter.part_votes must return shape (n_parts, n) = "
            f"({n_parts}, {features.shape[0]}), got {votes.shape}"
        )
    if not np.issubdtype(votes.dtype, np.integer):
        raise ValueError(
            f"voter.part_votes must return integers, got dtype {votes.dtype}"
        )
    return vote_counts(votes, n_classes, abstain=True)
