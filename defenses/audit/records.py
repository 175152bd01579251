"""The records of an audit: members, non-members, and the splits built from them.

The user hands over records as ``(X, y)`` pairs (or :class:`~defenses.data.Dataset`).
Features may have any per-record shape (``(d,)`` for a table, ``(1, 8, 8)`` for an
image); they are flattened to rows of length d, the shape the attacks and their priors
work in. Labels are encoded to column indices of the model's answers: through the
model's ``classes_`` when it has them (so string labels work), else they must already
be integers in ``[0, K)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.checks import as_numbers
from defenses.data import Dataset

Records = tuple[npt.ArrayLike, npt.ArrayLike] | Dataset


def _features(name: str, X: npt.ArrayLike) -> FloatArray:
    if np.iscomplexobj(X):
        raise TypeError(f"{name} features must be real numbers, got complex")
    arr = as_numbers(f"{name} features", X, error=TypeError)
    if arr.ndim < 2 or arr.shape[0] == 0:
        raise ValueError(
            f"{name} features must have shape (n >= 1, ...) with one record per row, "
            f"got {arr.shape}"
        )
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} features contain NaN or inf")
    return arr


def encode_labels(
    name: str, y: npt.ArrayLike, n: int, classes: npt.NDArray[Any] | None
) -> IntArray:
    """Column indices of the labels ``y`` (through ``classes`` when given)."""
    labels = np.asarray(y)
    if labels.shape != (n,):
        raise ValueError(f"{name} labels must have shape ({n},), got {labels.shape}")
    if classes is not None:
        index = {value: i for i, value in enumerate(classes.tolist())}
        unknown = sorted({str(v) for v in labels.tolist() if v not in index})
        if unknown:
            raise ValueError(
                f"{name} labels {unknown[:5]} are not among the model's classes_ "
                f"{classes.tolist()[:10]}"
            )
        return np.asarray([index[v] for v in labels.tolist()], dtype=np.int64)
    if labels.dtype == np.bool_ or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{name} labels must be integers (column indices of the model's "
            f"answers), got dtype {labels.dtype}"
        )
    if labels.min() < 0:
        raise ValueError(f"{name} labels must be >= 0, got {labels.min()}")
    return labels.astype(np.int64)


def to_dataset(
    name: str, records: Records, classes: npt.NDArray[Any] | None
) -> tuple[Dataset, tuple[int, ...]]:
    """Flat, encoded records and the shape of one record.

    A :class:`~defenses.data.Dataset` is taken as its flat ``X`` (the form its
    models take); pass ``input_shape`` to :func:`~defenses.audit.audit` otherwise.
    """
    y: npt.ArrayLike
    if isinstance(records, Dataset):
        arr, y = _features(name, records.X), records.y
        shape = tuple(arr.shape[1:])
    elif isinstance(records, tuple | list) and len(records) == 2:
        arr, y = _features(name, records[0]), records[1]
        shape = tuple(arr.shape[1:])
    else:
        raise TypeError(f"{name} must be an (X, y) pair or a Dataset")
    flat = arr.reshape(arr.shape[0], -1)
    labels = encode_labels(name, y, flat.shape[0], classes)
    return Dataset(flat, labels, name, int(labels.max()) + 1), tuple(shape)


@dataclass(frozen=True, eq=False)
class AuditData:
    """Everything the challenger holds, flat and encoded.

    Attributes
    ----------
    members, non_members : Dataset
        Records the model was and was not trained on.
    test : Dataset
        Records for utility (accuracy); the non-members unless given.
    val : Dataset
        Records a post-processing defense is fitted on (SSD's class prototypes); the
        test records unless given.
    input_shape : tuple of int
        Shape of one record as the model takes it.
    n_classes : int
        Number of columns of the model's answers.
    """

    members: Dataset
    non_members: Dataset
    test: Dataset
    val: Dataset
    input_shape: tuple[int, ...]
    n_classes: int

    @property
    def train(self) -> Dataset:
        """The members (what the model was trained on)."""
        return self.members

    def bounds(self) -> tuple[float, float]:
        """The range of every feature value in the records (the inversion's box)."""
        parts = (self.members.X, self.non_members.X)
        return (
            float(min(p.min() for p in parts)),
            float(max(p.max() for p in parts)),
        )


def with_classes(data: Dataset, n_classes: int) -> Dataset:
    """``data`` declared over ``n_classes`` columns (labels checked to fit)."""
    if data.y.max() >= n_classes:
        raise ValueError(
            f"{data.name} labels reach {data.y.max()}, but the model answers only "
            f"{n_classes} classes"
        )
    return Dataset(data.X, data.y, data.name, n_classes)


def candidates(
    data: AuditData, rng: np.random.Generator
) -> tuple[FloatArray, IntArray, npt.NDArray[np.bool_]]:
    """Members and non-members shuffled together: rows, labels, membership bits."""
    X = np.concatenate([data.members.X, data.non_members.X])
    y = np.concatenate([data.members.y, data.non_members.y])
    bits = np.concatenate(
        [np.ones(len(data.members), bool), np.zeros(len(data.non_members), bool)]
    )
    order = rng.permutation(X.shape[0])
    return X[order], y[order], bits[order]


def private_classes(
    name: str, private: Any, classes: npt.NDArray[Any] | None, n_classes: int
) -> IntArray:
    """Column indices of the classes marked private (one label or a sequence)."""
    values: Sequence[Any] = (
        list(private) if isinstance(private, list | tuple | np.ndarray) else [private]
    )
    if not values:
        raise ValueError(f"{name} must name at least one class")
    encoded = encode_labels(name, np.asarray(values), len(values), classes)
    if encoded.max() >= n_classes:
        raise ValueError(
            f"{name} {list(values)} is not a class of a {n_classes}-class model"
        )
    return np.unique(encoded)
