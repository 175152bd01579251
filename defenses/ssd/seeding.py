r"""Input-hash seeding of SSD's pseudo-labels (the paper's Appendix H).

A query's pseudo-label is drawn with a uniform number that is a keyed hash of the
query, :math:`u = \lfloor \mathrm{BLAKE2b}_\kappa(\text{row bytes}) / 2^{11} \rfloor
/ 2^{53}`, so repeating a query returns the same answer and voting over repeats gains
nothing. With a ``resolution`` :math:`r` each entry is first rounded to the grid,
:math:`\operatorname{round}(x / r)`, so that tiny perturbations of a query share its
answer (a coarse stand-in for locality-sensitive hashing). Entries too large for the
grid (:math:`|x / r| \ge 2^{52}`, where a float has no fraction left to round, and
inf) and NaN keep their own value and are tagged as such, so they neither collide
with each other nor with grid points.

The row bytes are canonical: ``-0.0`` is ``0.0`` and every NaN the same NaN; a
:class:`pandas.DataFrame` row is hashed by :func:`pandas.util.hash_pandas_object`
(any column types), a sparse row by its sorted non-zero positions and values.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import numpy as np

from defenses.arrays import FloatArray
from defenses.checks import as_numbers
from defenses.ssd.lazy import is_sparse, is_tensor

Seeding = Literal["random", "input-hash"]
SEEDINGS: tuple[str, ...] = ("random", "input-hash")

GRID_LIMIT = 2.0**52
"""Above this many grid steps an entry keeps its own value (no fraction to round)."""
HASH_BUFFER_BYTES = 2**18
"""Rows' canonical bytes are built and hashed in buffers of about this size, so the
extra memory of input-hash seeding does not grow with the batch."""


def _grid(values: FloatArray, resolution: float | None) -> tuple[FloatArray, Any]:
    """Canonical entries (rounded to the grid if given) and the off-grid tags."""
    if resolution is None:
        canonical = values + 0.0
        off_grid = np.zeros(values.shape, dtype=np.bool_)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = values / resolution
        off_grid = ~(np.abs(scaled) < GRID_LIMIT)
        canonical = np.where(off_grid, values, np.round(scaled)) + 0.0
    canonical[np.isnan(canonical)] = np.nan
    return canonical, off_grid


def _frame_keys(frame: Any, resolution: float | None) -> list[bytes]:
    import pandas as pd  # type: ignore[import-untyped]

    if isinstance(frame, pd.Series):
        frame = frame.to_frame()
    if resolution is not None:
        frame = frame.copy()
        for column in frame.select_dtypes("number").columns:
            values, off_grid = _grid(frame[column].to_numpy(np.float64), resolution)
            frame[column] = values
            frame[f"{column!r} off grid"] = off_grid
    hashes = pd.util.hash_pandas_object(frame, index=False).to_numpy(np.uint64)
    return [h.tobytes() for h in hashes]


def _sparse_keys(matrix: Any, resolution: float | None) -> list[bytes]:
    import scipy.sparse

    csr = scipy.sparse.csr_matrix(matrix, dtype=np.float64, copy=True)
    csr.sum_duplicates()
    csr.eliminate_zeros()
    values, off_grid = _grid(csr.data, resolution)
    keys = []
    for row in range(csr.shape[0]):
        lo, hi = csr.indptr[row], csr.indptr[row + 1]
        keys.append(
            csr.indices[lo:hi].astype(np.int64).tobytes()
            + values[lo:hi].tobytes()
            + off_grid[lo:hi].tobytes()
        )
    return keys


def _numeric_rows(inputs: Any) -> FloatArray:
    """``inputs`` as a real 2-D array, one row per query (TypeError otherwise)."""
    if is_tensor(inputs):
        inputs = inputs.detach().cpu().numpy()
    array = np.asarray(inputs)
    if array.dtype.kind == "c":
        raise TypeError(f"inputs must be real, got {array.dtype}")
    rows = as_numbers(
        "inputs (or a DataFrame, or a sparse matrix)", array, error=TypeError
    )
    out: FloatArray = rows.reshape(rows.shape[0], int(np.prod(rows.shape[1:])))
    return out


def _array_rows(inputs: Any, resolution: float | None) -> tuple[Any, int]:
    """:func:`_row_buffer` of the whole of ``inputs``."""
    return _row_buffer(_numeric_rows(inputs), resolution)


def _row_buffer(rows: FloatArray, resolution: float | None) -> tuple[Any, int]:
    """Each row's canonical bytes (float64 values, then off-grid tags) in one buffer.

    Returns the buffer, zero-padded to whole 128-byte BLAKE2b blocks (at least one),
    and the number of message bytes per row.
    """
    values, off_grid = _grid(rows, resolution)
    n, d = rows.shape
    length = 9 * d
    buffer = np.zeros((n, max(1, -(-length // 128)) * 128), dtype=np.uint8)
    buffer[:, : 8 * d] = np.ascontiguousarray(values).view(np.uint8).reshape(n, 8 * d)
    buffer[:, 8 * d : length] = off_grid.view(np.uint8)
    return buffer, length


def _array_keys(inputs: Any, resolution: float | None) -> list[bytes]:
    buffer, length = _array_rows(inputs, resolution)
    return [row[:length].tobytes() for row in buffer]


def _checked(inputs: Any, n: int) -> tuple[Any, str]:
    """``inputs`` (an array if it had no shape) and its kind: frame, sparse or array."""
    module = type(inputs).__module__
    try:
        if not hasattr(inputs, "shape"):
            inputs = np.asarray(inputs)
        shape = tuple(inputs.shape)
    except ValueError as error:
        raise ValueError(f"inputs must be rectangular: {error}") from error
    if not shape or shape[0] != n:
        raise ValueError(
            f"inputs must have one row per row of probs ({n}), got shape {shape}"
        )
    if module.startswith("pandas"):
        return inputs, "frame"
    return inputs, "sparse" if is_sparse(inputs) else "array"


def input_keys(inputs: Any, n: int, resolution: float | None) -> list[bytes]:
    """One canonical byte string per row of ``inputs`` (rounded to the grid if given).

    Raises
    ------
    ValueError
        If ``inputs`` does not have exactly ``n`` rows (one per probability row).
    TypeError
        If ``inputs`` is complex or not numeric (arrays; frames may hold anything).
    """
    inputs, kind = _checked(inputs, n)
    if kind == "frame":
        return _frame_keys(inputs, resolution)
    if kind == "sparse":
        return _sparse_keys(inputs, resolution)
    return _array_keys(inputs, resolution)


def input_uniforms(
    inputs: Any, n: int, resolution: float | None, key: np.uint64
) -> FloatArray:
    """:func:`hash_uniforms` of :func:`input_keys`, arrays hashed in one compiled loop.

    An array's rows all have the same length, so their keyed BLAKE2b-64 digests are
    computed by :func:`~defenses.ssd.kernels.blake2b.blake2b_rows` over buffers of
    about :data:`HASH_BUFFER_BYTES` (the same digests as :mod:`hashlib`'s, without
    a Python call per row); frames and sparse rows go through :mod:`hashlib`.
    Raises as :func:`input_keys`.
    """
    from defenses.ssd.kernels import plain
    from defenses.ssd.kernels.background import pick
    from defenses.ssd.kernels.blake2b import IV, blake2b_rows  # imports numba

    inputs, kind = _checked(inputs, n)
    if kind != "array":
        return hash_uniforms(input_keys(inputs, n, resolution), key.tobytes())
    rows = _numeric_rows(inputs)
    padded = max(1, -(-9 * rows.shape[1] // 128)) * 128
    step = max(1, HASH_BUFFER_BYTES // padded)
    out = np.empty(rows.shape[0])
    for start in range(0, rows.shape[0], step):
        buffer, length = _row_buffer(rows[start : start + step], resolution)
        args = (buffer.view(np.uint64), length, key, IV)
        out[start : start + step] = pick(blake2b_rows, plain.blake2b_rows, args)(*args)
    return out


def hash_uniforms(keys: list[bytes], key: bytes) -> FloatArray:
    """Uniforms in [0, 1): the top 53 bits of each row's keyed BLAKE2b-64 hash."""
    words = np.fromiter(
        (
            int.from_bytes(
                hashlib.blake2b(k, key=key, digest_size=8).digest(), "little"
            )
            >> 11
            for k in keys
        ),
        dtype=np.float64,
        count=len(keys),
    )
    out: FloatArray = words * 2.0**-53
    return out
