"""Checks of what a user hands to an unlearner: features, labels, ids, groups.

Every check runs at the boundary and raises ``ValueError`` naming the parameter.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from defenses.s3t import partition


def features(X: npt.ArrayLike, in_dim: int) -> npt.NDArray[np.float32]:
    """``X`` as float32 of shape ``(n, in_dim)``, ``n > 0``, finite."""
    array = np.asarray(X, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != in_dim:
        raise ValueError(f"X must have shape (n, {in_dim}), got {array.shape}")
    if array.shape[0] == 0:
        raise ValueError("X is empty")
    if not np.all(np.isfinite(array)):
        raise ValueError("X must be finite (found NaN or inf)")
    return array.astype(np.float32)


def labels(y: npt.ArrayLike, n: int, k: int) -> npt.NDArray[np.int64]:
    """``y`` as int64 of shape ``(n,)`` with values in ``[0, k)``."""
    array = np.asarray(y)
    if array.shape != (n,):
        raise ValueError(f"y must have shape ({n},), got {array.shape}")
    if array.dtype.kind not in "iu":
        raise ValueError(f"y must hold integer labels, got dtype {array.dtype}")
    if array.min() < 0 or array.max() >= k:
        raise ValueError(
            f"labels must lie in [0, {k}), got [{array.min()}, {array.max()}]"
        )
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
        raise ValueError(f"duplicate ids at fit: {values[counts > 1][:5].tolist()}")
    source = idx if groups is None else partition.check_ids(groups, "groups")
    if source.shape != (n,):
        raise ValueError(f"groups must have shape ({n},), got {source.shape}")
    return idx, source
