"""Deterministic, isolated training of one classifier per hash part.

The training certificate of RPS assumes that an unchanged part yields an identical
classifier (Scholten & Günnemann, ICLR 2025, Sec. on training isolation). This
module enforces it:

* each part is trained on its own rows only, in canonical (label, row) order, of
  the type the user gave (array, sparse matrix or DataFrame);
* a scikit-learn estimator is cloned per part and, if it has a ``random_state``
  parameter, gets the seed ``(random_state * 7919 + part) mod 2**32`` (per-part
  normalisation comes for free with a ``Pipeline`` holding a scaler);
* a torch model factory is trained full-batch by :class:`TorchPartClassifier` with
  its own initialisation, inside a forked torch RNG seeded per part, on one thread;
* a part holding a single class becomes a constant predictor;
* a part whose training fails raises (a ValueError or TypeError of the estimator as
  is, with a note naming the part; anything else as :class:`PartTrainingError`): a
  part is never dropped silently.

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
from scipy import sparse
from sklearn.base import BaseEstimator, clone
from sklearn.exceptions import NotFittedError
from sklearn.utils import _safe_indexing
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from defenses.arrays import FloatArray, IntArray
from defenses.checks import as_numbers, check_int, check_real
from defenses.rps.partition import n_rows, partition

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ModelFactory = Callable[[int, int], "torch.nn.Module"]


class PartTrainingError(RuntimeError):
    """A part's classifier could not be trained."""


@runtime_checkable
class PartClassifier(Protocol):
    """What a part's classifier offers once fitted: labels in ``0..K-1``."""

    def predict(self, X: Any) -> npt.NDArray[Any]:
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

    def predict(self, X: Any) -> IntArray:
        """The constant label for each row."""
        return np.full(n_rows(X), self.label, dtype=np.int64)


ABSTAIN = ConstantClassifier(-1)
"""The classifier of a part that received no training point: it abstains."""


class TorchPartClassifier(BaseEstimator):  # type: ignore[misc]
    """Full-batch, deterministic training of a torch model built by a factory.

    The factory's own initialisation is used as is: the model is built and trained
    inside :func:`torch.random.fork_rng` seeded with ``seed``, so the global torch
    generator is left as it was and the part is the same bit for bit on every run.

    Parameters
    ----------
    factory : callable
        ``factory(n_features, n_classes)`` returns an untrained ``torch.nn.Module``
        mapping (n, d) float32 inputs to (n, K) logits.
    epochs : int
        Full-batch Adam steps.
    lr : float
        Adam learning rate in (0, 1e6]; a run whose loss ends NaN or inf raises.
    seed : int
        Seed of the part's initialisation and training.
    """

    def __init__(
        self, factory: ModelFactory, epochs: int = 200, lr: float = 0.01, seed: int = 0
    ) -> None:
        self.factory = factory
        self.epochs = epochs
        self.lr = lr
        self.seed = seed

    def fit(
        self, X: Any, y: npt.NDArray[np.integer], n_classes: int | None = None
    ) -> TorchPartClassifier:
        """Train on (X, y) (labels ``0..K-1``) with one thread and a forked RNG."""
        import torch

        if not callable(self.factory):
            raise ValueError(f"factory must be callable, got {self.factory!r}")
        epochs = check_int("epochs", self.epochs, 1)
        lr = check_real("lr", self.lr, 0.0, 1e6, open_low=True)
        seed = check_int("seed", self.seed, 0, 2**63 - 1)
        inputs = torch.as_tensor(float32_rows(X))
        targets = torch.as_tensor(np.asarray(y), dtype=torch.int64)
        k = int(targets.max()) + 1 if n_classes is None else n_classes
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = self.factory(inputs.shape[1], k)
                optimizer = torch.optim.Adam(model.parameters(), lr=lr)
                loss_fn = torch.nn.CrossEntropyLoss()
                model.train()
                for _ in range(epochs):
                    optimizer.zero_grad()
                    loss = loss_fn(model(inputs), targets)
                    loss.backward()
                    optimizer.step()
                final = float(loss.detach())
        finally:
            torch.set_num_threads(threads)
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        if not (np.isfinite(final) and finite):
            raise ValueError(
                f"training diverged (loss {final}) at lr={lr}: use a smaller lr"
            )
        self.model_ = model.eval()
        self.classes_ = np.arange(k, dtype=np.int64)
        return self

    def predict(self, X: Any) -> IntArray:
        """Arg-max of the logits."""
        import torch

        if not hasattr(self, "model_"):
            raise NotFittedError("TorchPartClassifier is not fitted: call fit first")
        with torch.no_grad():
            logits = self.model_(torch.as_tensor(float32_rows(X)))
        return np.asarray(logits.argmax(dim=1).numpy(), dtype=np.int64)


def float32_rows(X: Any) -> npt.NDArray[np.float32]:
    """``X`` as a dense float32 array, finite after the cast, or raise ValueError."""
    if sparse.issparse(X):
        X = X.toarray()
    array = as_numbers("X of a torch part model", X, np.float32)
    if array.ndim != 2:
        raise ValueError(f"X must be 2-D (n_samples, n_features), got {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(
            "X holds NaN or inf (or values beyond float32's range) after the cast to "
            "float32, which a torch part model computes in"
        )
    return array


def _fresh(estimator: Any, part: int, random_state: int) -> Any:
    seed = (random_state * 7919 + part) % 2**32
    if isinstance(estimator, BaseEstimator):
        model = clone(estimator)
        params = model.get_params(deep=False)
        if isinstance(model, TorchPartClassifier):
            model.set_params(seed=seed)
        elif "random_state" in params:
            model.set_params(random_state=seed)
        return model
    if callable(estimator):
        return TorchPartClassifier(estimator, seed=seed)
    raise TypeError(
        "estimator must be a scikit-learn classifier, a TorchPartClassifier or a "
        f"torch model factory (n_features, n_classes) -> Module, got {estimator!r}"
    )


def check_estimator(estimator: Any) -> None:
    """Raise TypeError unless ``estimator`` is a usable base learner."""
    _fresh(estimator, 0, 0)
    if isinstance(estimator, BaseEstimator) and not hasattr(estimator, "predict"):
        raise TypeError(f"estimator {estimator!r} has no predict method")


def train_part(
    estimator: Any,
    X: Any,
    y: IntArray,
    n_classes: int,
    part: int,
    random_state: int,
) -> PartClassifier:
    """Train one part (rows already in canonical order).

    A ValueError or TypeError of the estimator (bad input, e.g. NaN for a model
    that refuses it) is raised as is, with a note naming the part; any other
    failure becomes a :class:`PartTrainingError`.
    """
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
    except (ValueError, TypeError) as error:
        error.add_note(f"(while training RPS part {part} on {y.size} samples)")
        raise
    except Exception as error:
        raise PartTrainingError(
            f"training part {part} failed ({y.size} samples, classes "
            f"{classes.tolist()}): {type(error).__name__}: {error}"
        ) from error
    return fitted


def train_parts(
    estimator: Any,
    X: Any,
    y: IntArray,
    n_parts: int,
    n_classes: int,
    random_state: int = 0,
    n_jobs: int | None = None,
) -> tuple[list[PartClassifier], list[IntArray]]:
    """Hash-partition (X, y) and train one classifier per part.

    ``X`` (array, sparse matrix or DataFrame) reaches each part's estimator as its
    own rows of the same type. A part that received no point abstains
    (:data:`ABSTAIN`; a poisoned point inserted there makes it vote, a move the
    abstain-aware bounds of :mod:`defenses.rps.scores` cover). Returns the fitted
    classifiers and each part's row indices.
    """
    parts = partition(X, y, n_parts, allow_empty=True)
    filled = [i for i, p in enumerate(parts) if p.size]
    jobs = [
        delayed(train_part)(
            estimator,
            _safe_indexing(X, parts[i]),
            y[parts[i]],
            n_classes,
            i,
            random_state,
        )
        for i in filled
    ]
    if n_jobs == 1 or len(jobs) == 1:
        trained = [job[0](*job[1], **job[2]) for job in jobs]
    else:
        trained = list(Parallel(n_jobs=n_jobs)(jobs))
    models: list[PartClassifier] = [ABSTAIN] * n_parts
    for i, model in zip(filled, trained, strict=True):
        models[i] = model
    if len(filled) < n_parts:
        logger.info(
            "%d of %d training parts are empty: they abstain",
            n_parts - len(filled),
            n_parts,
        )
    return models, parts


def predict_parts(models: Sequence[PartClassifier], X: Any) -> IntArray:
    """Predictions of every part, shape (k_t, n)."""
    return np.stack([np.asarray(m.predict(X), dtype=np.int64) for m in models])


def proba_columns(model: Any, X: Any, n_classes: int) -> FloatArray:
    """``predict_proba`` of a single model, spread over all ``n_classes`` columns."""
    n = n_rows(X)
    if not hasattr(model, "predict_proba"):
        labels = np.asarray(model.predict(X), dtype=np.int64)
        out = np.zeros((n, n_classes))
        out[np.arange(n), labels] = 1.0
        return out
    proba = np.asarray(model.predict_proba(X), dtype=np.float64)
    if not np.all(np.isfinite(proba)):
        bad = int(np.count_nonzero(~np.isfinite(proba).all(axis=1)))
        raise ValueError(
            f"the estimator's predict_proba returned NaN or inf for {bad} row(s) of "
            "X (values beyond what the model computes with?)"
        )
    known = np.asarray(
        getattr(model, "classes_", np.arange(proba.shape[1])), dtype=np.int64
    )
    out = np.zeros((n, n_classes))
    out[:, known] = proba
    return out


def voter_votes(voter: PartVoter, features: Any, n_parts: int) -> IntArray:
    """Votes (n_parts, n) of a :class:`PartVoter`, checked against its contract."""
    if voter.n_parts != n_parts:
        raise ValueError(
            f"voter.n_parts changed from {n_parts} to {voter.n_parts}: it must "
            "stay fixed for the life of the ensemble (a part without data "
            "abstains)"
        )
    votes = np.asarray(voter.part_votes(features))
    n = n_rows(features)
    if votes.shape != (n_parts, n):
        raise ValueError(
            f"voter.part_votes must return shape (n_parts, n) = ({n_parts}, {n}), "
            f"got {votes.shape}"
        )
    if not np.issubdtype(votes.dtype, np.integer):
        raise ValueError(
            f"voter.part_votes must return integers, got dtype {votes.dtype}"
        )
    return votes.astype(np.int64)
