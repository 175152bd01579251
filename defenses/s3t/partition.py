"""Stable assignment of samples to shards and slices by hashing their ids.

Exact unlearning needs a partition that does not move other points when one is
removed (an index-based split would shift every later point, so a system trained
without ``x`` would not match the deactivated one). Each sample's key is a salted
BLAKE2b digest of its id (or of its group, for user-level deletion); its shard is
``key mod m``, its slice ``(key div m) mod L``, and within a slice samples are
ordered by key. All three depend on the sample alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

IdArray = npt.NDArray[np.generic]
UIntArray = npt.NDArray[np.uint64]


def _from_objects(array: npt.NDArray[np.object_], what: str) -> IdArray:
    """An object array (a pandas Series of str, a list of mixed objects) as ints or str.

    Accepted when every value is an integer (not a bool) or every value is a string;
    the first value of another kind is named.
    """
    values = array.tolist()
    integral = [
        isinstance(v, int | np.integer) and not isinstance(v, bool) for v in values
    ]
    if all(integral):
        try:
            return np.asarray(values, dtype=np.int64)
        except OverflowError as error:
            raise ValueError(f"{what}: an integer id does not fit in int64") from error
    textual = [isinstance(v, str) for v in values]
    if all(textual):
        return np.asarray(values, dtype=str)
    kind = integral if sum(integral) >= sum(textual) else textual
    i = kind.index(False)
    raise ValueError(
        f"{what} must be all integers or all strings, got {type(values[i]).__name__} "
        f"{values[i]!r} at position {i}"
    )


def check_ids(ids: npt.ArrayLike, what: str = "ids") -> IdArray:
    """Return ``ids`` as a 1-D array of integers or strings, or raise ValueError.

    Numpy arrays, lists and pandas Series are accepted; an object array (what a
    Series of strings or a list of mixed objects becomes) is converted when all its
    values are integers or all are strings.
    """
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return array.astype(np.int64)
    if array.dtype.kind == "O":
        array = _from_objects(array, what)
    if array.dtype.kind not in "iuU":
        raise ValueError(f"{what} must be integers or strings, got dtype {array.dtype}")
    return array


def id_token(value: object) -> str:
    """Canonical text of one id: ``i:<int>`` or ``s:<str>``."""
    if isinstance(value, np.integer | int) and not isinstance(value, bool):
        return f"i:{int(value)}"
    if isinstance(value, np.str_ | str):
        return f"s:{value}"
    raise ValueError(f"ids must be integers or strings, got {value!r}")


def digest(value: object, salt: str) -> bytes:
    """Salted 16-byte BLAKE2b digest of one id."""
    return hashlib.blake2b(
        id_token(value).encode(), digest_size=16, key=salt.encode()[:64]
    ).digest()


def keys(values: Sequence[object] | IdArray, salt: str) -> UIntArray:
    """64-bit partition keys of ids (the first 8 bytes of their digests)."""
    return np.array(
        [int.from_bytes(digest(v, salt)[:8], "big") for v in values], dtype=np.uint64
    )


def assign(key: UIntArray, shards: int, slices: int) -> tuple[UIntArray, UIntArray]:
    """Shard ``key mod m`` and slice ``(key div m) mod L`` of every key."""
    m, length = np.uint64(shards), np.uint64(slices)
    return key % m, (key // m) % length
