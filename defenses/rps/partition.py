"""Hash partitioning of a data set into disjoint parts.

RPS (Scholten & Günnemann, ICLR 2025, Alg. 1 and 2) assigns a point to part
``h(x) mod k`` with a hash ``h`` of the input alone. The certificates rely on three
properties that this module guarantees:

* the part depends on ``x`` only: not on the label, nor on the position in the data
  set, so a label flip keeps a point in its part and an insertion or deletion
  touches exactly one part;
* each part is put in a canonical order (lexicographic in (label, features)), so a
  part's training run does not depend on the order of the data set;
* a feature modification may move a point between parts (it then counts as two
  changes).

The hash is CRC-32 of the point's float64 bytes, which balances parts better than
the official code's truncated pixel sum.
"""

from __future__ import annotations

import zlib

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def check_features(X: npt.ArrayLike, name: str = "X") -> FloatArray:
    """Return ``X`` as a finite float64 (n, d) array, or raise ValueError."""
    array = np.asarray(X, dtype=np.float64)
    if array.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (n, d), got shape {array.shape}")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"{name} must not be empty, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        bad = int(np.count_nonzero(~np.isfinite(array).all(axis=1)))
        raise ValueError(f"{name} holds NaN or inf features in {bad} row(s)")
    return array


def hash_rows(X: npt.ArrayLike) -> npt.NDArray[np.uint32]:
    """CRC-32 of each row's float64 bytes (a function of the row alone)."""
    array = np.ascontiguousarray(check_features(X))
    return np.fromiter(
        (zlib.crc32(row.tobytes()) for row in array), dtype=np.uint32, count=len(array)
    )


def part_of(X: npt.ArrayLike, n_parts: int) -> IntArray:
    """Part index ``crc32(x) mod n_parts`` of each row of ``X``."""
    if isinstance(n_parts, bool) or not isinstance(n_parts, int | np.integer):
        raise ValueError(f"n_parts must be an integer >= 1, got {n_parts!r}")
    if n_parts < 1:
        raise ValueError(f"n_parts must be an integer >= 1, got {n_parts!r}")
    return (hash_rows(X) % np.uint32(n_parts)).astype(np.int64)


def canonical_order(X: FloatArray, y: npt.NDArray[np.integer]) -> IntArray:
    """Indices sorting the rows by label, then lexicographically by features."""
    keys = [X[:, j] for j in range(X.shape[1] - 1, -1, -1)]
    return np.lexsort([*keys, y]).astype(np.int64)


def partition(X: npt.ArrayLike, y: npt.ArrayLike, n_parts: int) -> list[IntArray]:
    """Indices of each part, each in canonical (label, features) order.

    Raises
    ------
    ValueError
        If there are more parts than samples or a part ends up empty.
    """
    features = check_features(X)
    labels = np.asarray(y)
    if labels.shape != (features.shape[0],):
        raise ValueError(
            f"y must have shape ({features.shape[0]},), got {labels.shape}"
        )
    if n_parts > features.shape[0]:
        raise ValueError(
            f"n_parts={n_parts} exceeds the number of samples ({features.shape[0]})"
        )
    parts = part_of(features, n_parts)
    out: list[IntArray] = []
    for i in range(n_parts):
        members = np.flatnonzero(parts == i)
        if members.size == 0:
            raise ValueError(
                f"part {i} of {n_parts} received no sample (n={features.shape[0]}); "
                "use fewer parts"
            )
        order = canonical_order(features[members], labels[members])
        out.append(members[order].astype(np.int64))
    return out
