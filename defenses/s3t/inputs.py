"""Checks of what a user hands to an unlearner or to :func:`pretrain`.

Every check runs at the boundary, in the dtype the model computes in, and raises
``ValueError`` (or ``TypeError`` for a wrong kind of object) naming the parameter:

* inputs are cast to float32 and must be finite *after* the cast (``1e39`` is
  finite in float64 but ``inf`` in float32), or, for a model with an
  ``nn.Embedding``, are integer token ids in ``[0, num_embeddings)``;
* labels may be of any type scikit-learn counts as classes (integers, strings,
  integral floats), checked by :func:`defenses.targets.check_labels`; they are
  encoded as ``0 .. K-1`` against the sorted ``classes_``. Continuous values
  (``1.7``), missing labels (NaN) and a single class are refused.
"""

from __future__ import annotations

import warnings

import numpy as np
import numpy.typing as npt

from defenses.checks import check_indices
from defenses.s3t import partition
from defenses.targets import check_labels

FLOAT32_MAX = float(np.finfo(np.float32).max)


def as_array(X: object, name: str) -> npt.NDArray[np.generic]:
    """``X`` as a numpy array of real numbers (no cast), or raise ValueError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            array = np.asarray(X)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{name} must be a rectangular array: {error}") from error
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{name} must hold real numbers, got dtype {array.dtype}")
    return array


def model_inputs(
    X: object,
    shape: tuple[int, ...] | None,
    tokens: int | None,
    name: str = "X",
) -> npt.NDArray[np.generic]:
    """``X`` as a batch for the model: float32 (finite) or int64 token ids.

    Parameters
    ----------
    X : array-like of shape (n, ...)
        The batch, ``n > 0``.
    shape : tuple or None
        Required shape of one sample (None: any, at least one dimension).
    tokens : int or None
        Vocabulary size when the model takes token ids (an ``nn.Embedding``).
    """
    array = as_array(X, name)
    if array.ndim < 2:
        raise ValueError(
            f"{name} must have shape (n_samples, ...) with at least 2 dimensions, "
            f"got {array.shape}"
        )
    if shape is not None and tuple(array.shape[1:]) != tuple(shape):
        raise ValueError(
            f"{name} must have shape (n, {', '.join(map(str, shape))}), "
            f"got {array.shape}"
        )
    if array.shape[0] == 0:
        raise ValueError(f"{name} is empty")
    if tokens is not None:
        if array.dtype.kind not in "iu":
            raise ValueError(
                f"{name} must hold integer token ids for a model with an "
                f"nn.Embedding, got dtype {array.dtype}"
            )
        check_indices(f"{name} token ids", array, tokens)
        return array.astype(np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        out = array.astype(np.float32)
    if not np.all(np.isfinite(out)):
        raise ValueError(
            f"{name} must be finite in float32 (found NaN, inf, or a magnitude "
            f"above {FLOAT32_MAX:.3g})"
        )
    return out


def encode_labels(
    y: object, n: int, name: str = "y"
) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.int64]]:
    """The sorted classes of ``y`` and its codes ``0 .. K-1`` (``K >= 2``)."""
    array = check_labels(y, "S3T", n)
    try:
        classes, codes = np.unique(array, return_inverse=True)
    except TypeError as error:
        raise ValueError(f"{name}: labels of mixed types ({error})") from error
    if classes.size < 2:
        raise ValueError(f"{name} holds a single class {classes.tolist()}; need >= 2")
    return classes, codes.astype(np.int64)


def class_codes(y: object, n: int, name: str = "y") -> npt.NDArray[np.int64]:
    """Integer labels ``>= 0`` used as class indices (no re-encoding)."""
    array = np.asarray(y)
    if array.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {array.shape}")
    if array.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold integer class indices, got {array.dtype}")
    if array.dtype.kind == "f" and not (
        np.all(np.isfinite(array)) and np.all(array == np.round(array))
    ):
        raise ValueError(f"{name} must hold integer class indices (found fractions)")
    if array.min() < 0:
        raise ValueError(f"{name} class indices must be >= 0, got {array.min()}")
    return array.astype(np.int64)


def fit_ids(
    ids: npt.ArrayLike, groups: npt.ArrayLike | None, n: int
) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]:
    """Unique sample ids of shape ``(n,)`` and the partition keys' source."""
    idx = partition.check_ids(ids)
    if idx.shape != (n,):
        raise ValueError(f"ids must have shape ({n},), got {idx.shape}")
    values, counts = np.unique(idx, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(
            f"ids: duplicate ids at fit: {values[counts > 1][:5].tolist()}"
        )
    source = idx if groups is None else partition.check_ids(groups, "groups")
    if source.shape != (n,):
        raise ValueError(f"groups must have shape ({n},), got {source.shape}")
    return idx, source
