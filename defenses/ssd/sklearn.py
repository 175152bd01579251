"""SSD for scikit-learn: a meta-estimator whose probabilities pass through the shield.

:class:`ShieldedClassifier` wraps any classifier with ``predict_proba``. ``fit``
holds out a stratified validation split (``val_size``), fits a clone of the
estimator on the rest and the shield's prototypes on the held-out outputs; with
``prefit=True`` the estimator is used as fitted and all of ``X, y`` is validation
data. Labels may be of any type (the estimator's ``classes_``; checked by
:func:`defenses.targets.check_labels`); the features go to
the estimator untouched (DataFrames, sparse matrices, NaN where it accepts them),
so the classifier works as the last step of a :class:`~sklearn.pipeline.Pipeline`,
in ``clone``, ``cross_val_score`` and ``GridSearchCV`` (over ``estimator__*`` and
``shield__*``).

Seeding. A deployed model answers the same query the same way: ``seeding`` defaults
to ``"input-hash"`` (the paper's App. H), so the pseudo-label of a row is a keyed hash
of the row and ``predict`` twice on the same rows agrees on every row. Under
``"random"`` (an explicit choice) each call draws fresh pseudo-labels, and an
attacker who repeats a query and takes the majority vote averages the randomness
away: the vote converges to the label SSD randomizes. The wrapper's ``seeding``
replaces the shield's in the fitted copy ``shield_`` (the given shield is never
changed).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt
import scipy.sparse
from sklearn.base import BaseEstimator, ClassifierMixin, MetaEstimatorMixin, clone
from sklearn.model_selection import train_test_split
from sklearn.utils import _safe_indexing
from sklearn.utils._tags import get_tags
from sklearn.utils.validation import check_consistent_length, check_is_fitted

from defenses.checks import check_choice, check_fraction
from defenses.ssd.seeding import SEEDINGS, Seeding
from defenses.targets import check_labels

logger = logging.getLogger(__name__)


class Shield(Protocol):
    """What the wrapper needs of a shield (a ``StealthyShield``)."""

    @property
    def n_classes(self) -> int:
        """Number of classes of the fitted prototypes."""
        ...

    def fit(self, val_probs: Any, val_labels: Any) -> Any:
        """Fit the prototypes."""
        ...

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor's parameters."""
        ...

    def set_params(self, **params: Any) -> Any:
        """Set parameters (validated)."""
        ...

    def __call__(self, probs: Any, inputs: Any = None) -> Any:
        """Defended probabilities."""
        ...


def _rows_indexable(X: Any) -> Any:
    """``X`` in a form whose rows can be picked (CSR for row-less sparse formats)."""
    if scipy.sparse.issparse(X):
        return X if X.format in ("csr", "csc") else X.tocsr()
    if hasattr(X, "iloc") or isinstance(X, np.ndarray | list):
        return X
    return np.asarray(X)


def _uncovered(
    labels: npt.NDArray[Any], train: npt.NDArray[np.intp], val: npt.NDArray[np.intp]
) -> npt.NDArray[np.intp]:
    """Training rows of the classes the validation split missed (one class each).

    A prototype needs at least one sample; on data too small for a stratified
    split, those classes fall back to the (over-confident) training outputs.
    """
    missing = np.setdiff1d(labels[train], labels[val])
    if missing.size:
        logger.warning(
            "ShieldedClassifier: classes %s have no validation sample; their "
            "prototypes use training outputs (give more data or a larger val_size)",
            missing.tolist(),
        )
    picked = [train[labels[train] == label][:1] for label in missing]
    return np.concatenate([np.empty(0, dtype=np.intp), *picked])


class ShieldedClassifier(MetaEstimatorMixin, ClassifierMixin, BaseEstimator):  # type: ignore[misc]
    """A classifier whose probabilities pass through SSD.

    Parameters
    ----------
    estimator : classifier with ``predict_proba``
        The model to protect (cloned by :meth:`fit` unless ``prefit``).
    shield : StealthyShield
        The defense's settings (cloned and fitted by :meth:`fit`; its ``seeding`` is
        replaced by this wrapper's).
    seeding : {"input-hash", "random"}
        ``"input-hash"`` (default): the same row always gets the same answer, so
        repeating a query and voting gains nothing. ``"random"``: fresh
        pseudo-labels at every call, which a voting attacker averages away.
    prefit : bool
        Use ``estimator`` as fitted; :meth:`fit` then only builds the prototypes.
    val_size : float
        Fraction of ``X`` held out for the prototypes, in (0, 1).
    random_state : int or None
        Seed of the validation split.
    """

    _required_parameters: ClassVar[list[str]] = ["estimator", "shield"]

    def __init__(
        self,
        estimator: Any,
        shield: Shield,
        *,
        seeding: Seeding = "input-hash",
        prefit: bool = False,
        val_size: float = 0.25,
        random_state: int | None = None,
    ) -> None:
        self.estimator = estimator
        self.shield = shield
        self.seeding = seeding
        self.prefit = prefit
        self.val_size = val_size
        self.random_state = random_state

    @classmethod
    def prefitted(
        cls, estimator: Any, shield: Shield, seeding: Seeding = "input-hash"
    ) -> ShieldedClassifier:
        """A fitted wrapper around a fitted ``estimator`` and a fitted ``shield``.

        ``shield_`` is a copy of ``shield`` (prototypes and key kept) answering
        with ``seeding``; the given shield is not changed.
        """
        check_choice("seeding", seeding, SEEDINGS)
        wrapped = cls(estimator, shield, seeding=seeding, prefit=True)
        wrapped.estimator_ = estimator
        wrapped.shield_ = copy.deepcopy(shield).set_params(seeding=seeding)
        wrapped.classes_ = np.asarray(
            getattr(estimator, "classes_", np.arange(shield.n_classes))
        )
        return wrapped

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        # a wrapped model that is no sklearn estimator keeps the default input tags
        with contextlib.suppress(AttributeError, TypeError):
            tags.input_tags = get_tags(self.estimator).input_tags
        tags.non_deterministic = self.seeding == "random"
        return tags

    def fit(self, X: Any, y: Any) -> ShieldedClassifier:
        """Fit the estimator (unless ``prefit``) and the shield's prototypes."""
        if not isinstance(self.prefit, bool | np.bool_):
            raise ValueError(f"prefit must be True or False, got {self.prefit!r}")
        seeding = check_choice("seeding", self.seeding, SEEDINGS)
        resolution = self.shield.get_params().get("hash_resolution")
        if seeding == "random" and resolution is not None:
            raise ValueError(
                f"seeding='random' draws fresh pseudo-labels, but the shield has "
                f"hash_resolution={resolution!r}, which needs seeding='input-hash'"
            )
        labels = check_labels(y, "ShieldedClassifier")
        X = _rows_indexable(X)
        check_consistent_length(X, labels)
        if self.prefit:
            check_is_fitted(self.estimator)
            self.estimator_ = self.estimator
            val_probs, y_val = self.estimator_.predict_proba(X), labels
        else:
            check_fraction("val_size", self.val_size)
            rows = np.arange(labels.shape[0])
            counts = np.unique(labels, return_counts=True)[1]
            stratify = labels if counts.min(initial=0) >= 2 else None
            train, val = train_test_split(
                rows,
                test_size=self.val_size,
                stratify=stratify,
                random_state=self.random_state,
            )
            val = np.concatenate([val, _uncovered(labels, train, val)])
            self.estimator_ = clone(self.estimator).fit(
                _safe_indexing(X, train), labels[train]
            )
            val_probs = self.estimator_.predict_proba(_safe_indexing(X, val))
            y_val = labels[val]
        self.classes_ = np.asarray(self.estimator_.classes_)
        positions = {label: i for i, label in enumerate(self.classes_.tolist())}
        unknown = sorted({v for v in y_val.tolist() if v not in positions}, key=str)
        if unknown:
            raise ValueError(f"y has labels the estimator does not know: {unknown}")
        codes = np.array([positions[v] for v in y_val.tolist()], dtype=np.int64)
        self.shield_ = clone(self.shield).set_params(seeding=seeding)
        self.shield_.fit(val_probs, codes)
        for name in ("n_features_in_", "feature_names_in_"):
            if hasattr(self.estimator_, name):
                setattr(self, name, getattr(self.estimator_, name))
        return self

    def predict_proba(self, X: Any) -> npt.NDArray[np.floating]:
        """Defended probabilities (columns in ``classes_`` order)."""
        check_is_fitted(self, "shield_")
        X = _rows_indexable(X)
        answers: npt.NDArray[np.floating] = self.shield_(
            np.asarray(self.estimator_.predict_proba(X)), inputs=X
        )
        return answers

    def predict(self, X: Any) -> Any:
        """Arg-max label of the defended probabilities, from ``classes_``."""
        probs = self.predict_proba(X)
        return self.classes_[np.argmax(probs, axis=1)]
