"""Hash partitioning of a data set into disjoint parts.

RPS (Scholten & Günnemann, ICLR 2025, Alg. 1 and 2) assigns a point to part
``h(x) mod k`` with a hash ``h`` of the input alone. The certificates rely on three
properties that this module guarantees:

* the part depends on ``x`` only: not on the label, nor on the position in the data
  set, so a label flip keeps a point in its part and an insertion or deletion
  touches exactly one part;
* each part is put in a canonical order (by label, then by the row), so a part's
  training run does not depend on the order of the data set;
* a feature modification may move a point between parts (it then counts as two
  changes).

Rows are hashed through canonical bytes, whatever the input type:

* a numeric array: CRC-32 of the row cast to float64, with ``-0.0`` written as
  ``0.0`` and every NaN as one NaN (it balances parts better than the official
  code's truncated pixel sum; integers and floats of equal value hash alike);
* a scipy sparse matrix: BLAKE2b (64 bits) of the row's sorted column indices
  (int64) and non-zero values (float64, canonical as above), so explicit zeros and
  the storage format do not matter;
* an all-numeric pandas DataFrame: as the equal numeric array (so a data set gets
  the same parts whatever its container); any other DataFrame (string or
  categorical columns): :func:`pandas.util.hash_pandas_object` with ``index=False``
  (the values and their dtypes, not the index);
* any other array (strings, objects): BLAKE2b of the row's ``repr`` of each value.

Numeric rows (arrays or all-numeric frames) are ordered lexicographically by their
values within a label; other
rows by their 64-bit hash (distinct rows with equal hashes, probability below
:math:`n^2 / 2^{65}`, keep their relative order in the data, which insertions and
deletions of other rows do not change).
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import sparse

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_int

HashArray = npt.NDArray[np.uint64]


def is_frame(X: object) -> bool:
    """Whether ``X`` is a pandas DataFrame (pandas is not imported for the check)."""
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(X, pandas.DataFrame)


def is_numeric(X: object) -> bool:
    """Whether ``X`` is a dense numpy array of booleans, integers or reals."""
    return isinstance(X, np.ndarray) and X.dtype.kind in "biuf"


def numeric_values(X: Any) -> npt.NDArray[Any] | None:
    """The numbers of a numeric array or all-numeric DataFrame; None otherwise."""
    if is_numeric(X):
        return np.asarray(X)
    if is_frame(X) and all(kind in "biuf" for kind in (d.kind for d in X.dtypes)):
        return np.asarray(X.to_numpy(dtype=np.float64, na_value=np.nan))
    return None


def n_rows(X: Any) -> int:
    """Number of rows of an array, sparse matrix or DataFrame."""
    return int(X.shape[0])


def _canonical_floats(values: npt.ArrayLike) -> FloatArray:
    array = np.array(values, dtype=np.float64)
    array += 0.0
    array[np.isnan(array)] = np.nan
    return array


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def hash_rows(X: Any) -> HashArray:
    """A hash of each row of ``X`` computed from that row alone (see the module)."""
    numbers = numeric_values(X)
    if numbers is not None:
        if numbers.ndim != 2:
            raise ValueError(f"X must be 2-D (n_samples, n), got {numbers.shape}")
        floats = np.ascontiguousarray(_canonical_floats(numbers))
        return np.fromiter(
            (zlib.crc32(row.tobytes()) for row in floats),
            dtype=np.uint64,
            count=len(floats),
        )
    if is_frame(X):
        from pandas.util import hash_pandas_object  # type: ignore[import-untyped]

        return np.asarray(hash_pandas_object(X, index=False), dtype=np.uint64)
    if sparse.issparse(X):
        rows = sparse.csr_array(X, dtype=np.float64, copy=True)
        rows.sum_duplicates()
        rows.eliminate_zeros()
        values = _canonical_floats(rows.data)
        indices = rows.indices.astype(np.int64)
        bounds = rows.indptr
        return np.fromiter(
            (
                _digest(indices[a:b].tobytes() + b"|" + values[a:b].tobytes())
                for a, b in itertools.pairwise(bounds.tolist())
            ),
            dtype=np.uint64,
            count=rows.shape[0],
        )
    array = np.asarray(X)
    if array.ndim != 2:
        raise ValueError(f"X must be 2-D (n_samples, n_features), got {array.shape}")
    if array.dtype.kind == "c":
        raise ValueError("Complex data not supported: X holds complex numbers")
    return np.fromiter(
        (_digest("\x1f".join(repr(v) for v in row.tolist()).encode()) for row in array),
        dtype=np.uint64,
        count=len(array),
    )


def part_of(X: Any, n_parts: int) -> IntArray:
    """Part index ``h(x) mod n_parts`` of each row of ``X``."""
    k = check_int("n_parts", n_parts, 1, 2**63 - 1)
    return (hash_rows(X) % np.uint64(k)).astype(np.int64)


def canonical_order(
    X: npt.NDArray[Any] | None, y: npt.NDArray[Any], hashes: HashArray
) -> IntArray:
    """Indices sorting rows by label, then by their values (numeric ``X``) or hash.

    ``X`` is the numeric array of the rows, or None for other inputs.
    """
    if X is not None:
        keys = [X[:, j] for j in range(X.shape[1] - 1, -1, -1)]
        return np.lexsort([*keys, y]).astype(np.int64)
    return np.lexsort([hashes, y]).astype(np.int64)


def partition(
    X: Any, y: npt.ArrayLike, n_parts: int, allow_empty: bool = False
) -> list[IntArray]:
    """Indices of each part, each in canonical (label, row) order.

    Parameters
    ----------
    X : array, sparse matrix or DataFrame of n rows
        The inputs (hashed, never changed).
    y : array of shape (n,)
        Labels (encoded or not: only their order is used).
    n_parts : int
        Number of parts.
    allow_empty : bool
        Return empty parts instead of raising.

    Raises
    ------
    ValueError
        If there are more parts than samples or (unless ``allow_empty``) a part
        ends up empty.
    """
    k = check_int("n_parts", n_parts, 1, 2**63 - 1)
    n = n_rows(X)
    labels = np.asarray(y)
    if labels.shape != (n,):
        raise ValueError(f"y must have shape ({n},), got {labels.shape}")
    if k > n:
        raise ValueError(f"n_parts={k} exceeds the number of samples (n_samples = {n})")
    hashes = hash_rows(X)
    parts = (hashes % np.uint64(k)).astype(np.int64)
    numeric = numeric_values(X)
    out: list[IntArray] = []
    for i in range(k):
        members = np.flatnonzero(parts == i)
        if members.size == 0 and not allow_empty:
            raise ValueError(
                f"part {i} of n_parts={k} received no sample (n_samples = {n}); "
                "use fewer parts"
            )
        order = canonical_order(
            None if numeric is None else numeric[members],
            labels[members],
            hashes[members],
        )
        out.append(members[order].astype(np.int64))
    return out
