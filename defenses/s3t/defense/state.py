"""The deletion bookkeeping of an unlearner: its data, its stages, its live table.

An :class:`Unlearner`'s whole state is one immutable :class:`State`: the surviving
fine-tuning rows (sorted by shard, slice and partition key), the stored stages by
``(shard, prefix)``, the *live table* (for every shard and order, the length of the
prefix still served) and the tombstones (salted digests of deleted ids, so that a
second deletion of an id is told apart from an unknown id without keeping the id).
Every operation builds a new state and commits it at the end, so a failure leaves the
old one in place.

Deleting from slice ``j`` of shard ``s`` sets, for every order ``pi`` of the shard,
``live[s][pi] = min(live[s][pi], pos_pi(j))`` and drops every stage of shard ``s``
whose prefix contains ``j`` (:func:`switch_off`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from torch import Tensor

from defenses.s3t import partition
from defenses.s3t.training import Order, SliceData, StageKey, StageState, slice_data

Slot = tuple[int, int]
"""A ``(shard, slice)`` cell."""


class NotFittedError(RuntimeError):
    """The model was used before :meth:`Unlearner.fit`."""


class UnknownIdError(KeyError, ValueError):
    """A requested id is unknown or already deleted (names ``ids``)."""


class AllShardsDeadError(RuntimeError):
    """Every shard lost its models to deletions: :meth:`Unlearner.retrain` first."""


@dataclass(frozen=True)
class Data:
    """The surviving fine-tuning data, sorted by (shard, slice, key).

    ``X`` holds the model inputs (float32, or int64 token ids), ``y`` the encoded
    labels ``0 .. K-1``.
    """

    X: npt.NDArray[np.generic]
    y: npt.NDArray[np.int64]
    ids: list[object]
    key: npt.NDArray[np.uint64]
    shard: npt.NDArray[np.uint64]
    slice: npt.NDArray[np.uint64]

    def without(self, rows: npt.NDArray[np.int64]) -> Data:
        """The data with ``rows`` removed."""
        keep = np.ones(len(self.ids), dtype=bool)
        keep[rows] = False
        return Data(
            self.X[keep],
            self.y[keep],
            [v for v, k in zip(self.ids, keep, strict=True) if k],
            self.key[keep],
            self.shard[keep],
            self.slice[keep],
        )

    def rows_of(self, shard: int, slc: int) -> npt.NDArray[np.intp]:
        """Row indices of one (shard, slice) cell, in key order."""
        return np.flatnonzero((self.shard == shard) & (self.slice == slc))

    def slices_of(self, shard: int, slices: int) -> dict[int, SliceData]:
        """The contents of every slice of one shard, as tensors."""
        out = {}
        for j in range(slices):
            rows = self.rows_of(shard, j)
            out[j] = slice_data(self.X[rows], self.y[rows], [self.ids[r] for r in rows])
        return out

    def empty_cells(self, shards: int, slices: int) -> list[Slot]:
        """The (shard, slice) cells that hold no row."""
        filled = {(int(s), int(j)) for s, j in zip(self.shard, self.slice, strict=True)}
        return [
            (s, j) for s in range(shards) for j in range(slices) if (s, j) not in filled
        ]


@dataclass(frozen=True)
class State:
    """Everything an unlearner holds (immutable; replaced on every operation)."""

    data: Data
    stages: Mapping[StageKey, StageState]
    live: tuple[tuple[int, ...], ...]
    tombstones: frozenset[bytes]
    shared_lineage: frozenset[object]
    classes: npt.NDArray[np.generic]
    input_shape: tuple[int, ...]


@dataclass(frozen=True)
class DeletionReceipt:
    """What a deletion did.

    Attributes
    ----------
    ids : tuple
        The deleted ids.
    slots : tuple of (shard, slice)
        The slices they lived in.
    deactivated : tuple of (shard, prefix)
        Stages switched off and erased (their adapters and heads saw a deleted id).
    served : tuple of prefixes
        The prefix each shard serves now (empty: the shard is dead).
    dead_shards : tuple of int
        Shards with no model left.
    needs_retrain : bool
        Whether some shard needs retraining to serve again.
    all_dead : bool
        Whether no shard can serve (prediction refuses until :meth:`retrain`).
    seconds : float
        Wall time of the deletion.
    """

    ids: tuple[object, ...]
    slots: tuple[Slot, ...]
    deactivated: tuple[StageKey, ...]
    served: tuple[Order, ...]
    dead_shards: tuple[int, ...]
    needs_retrain: bool
    all_dead: bool
    seconds: float


@dataclass(frozen=True)
class RetrainReceipt:
    """What a retraining did.

    Attributes
    ----------
    stages : tuple of (shard, prefix)
        Stages trained.
    passes : int
        Sample-gradient passes spent (samples x epochs, summed over the stages).
    seconds : float
        Wall time.
    empty : tuple of (shard, slice)
        Cells left without data by deletions. A stage whose prefix holds an empty
        cell is not trained (a fresh fit refuses such data), so the orders of that
        shard serve only up to the cell and a shard whose every order starts with an
        empty cell abstains.
    abstaining : tuple of int
        Shards with no model after the retraining.
    """

    stages: tuple[StageKey, ...]
    passes: int
    seconds: float
    empty: tuple[Slot, ...] = ()
    abstaining: tuple[int, ...] = ()


def served_prefixes(
    live: Sequence[Sequence[int]], orders: Sequence[Order]
) -> tuple[Order, ...]:
    """The prefix each shard serves: its longest live prefix (empty if dead)."""
    out = []
    for lengths in live:
        best = int(np.argmax(lengths))
        out.append(orders[best][: lengths[best]])
    return tuple(out)


def find_rows(
    state: State, request: Sequence[object], salt: str
) -> npt.NDArray[np.int64]:
    """Row of every requested id.

    Raises
    ------
    ValueError
        No ids, or an id twice.
    UnknownIdError
        An id is unknown or already deleted (told apart by the tombstones); a
        ``KeyError`` and a ``ValueError``.
    """
    if not request:
        raise ValueError("ids: no ids given to delete")
    if len(set(request)) != len(request):
        raise ValueError("ids: duplicate ids in one deletion request")
    where = {v: i for i, v in enumerate(state.data.ids)}
    rows = []
    for v in request:
        if v in where:
            rows.append(where[v])
        elif partition.digest(v, salt) in state.tombstones:
            raise UnknownIdError(f"ids: id {v!r} was already deleted")
        else:
            raise UnknownIdError(f"ids: unknown id {v!r}: it was never trained on")
    return np.asarray(rows, dtype=np.int64)


def switch_off(
    state: State, orders: Sequence[Order], slots: Iterable[Slot]
) -> tuple[State, tuple[StageKey, ...]]:
    """Cut every order at the hit slices and drop every stage that saw them."""
    live = [list(row) for row in state.live]
    hit = set(slots)
    for s, j in hit:
        for o, order in enumerate(orders):
            live[s][o] = min(live[s][o], order.index(j))
    dropped = tuple(
        sorted(k for k in state.stages if any(k[0] == s and j in k[1] for s, j in hit))
    )
    stages = {k: v for k, v in state.stages.items() if k not in dropped}
    new = dataclasses.replace(
        state, stages=stages, live=tuple(tuple(row) for row in live)
    )
    return new, dropped


def forget_rows(state: State, rows: npt.NDArray[np.int64], salt: str) -> State:
    """Erase ``rows`` from the data and tombstone their ids."""
    deleted = [state.data.ids[r] for r in rows]
    return dataclasses.replace(
        state,
        data=state.data.without(rows),
        tombstones=state.tombstones | {partition.digest(v, salt) for v in deleted},
    )


def partition_data(
    X: npt.NDArray[np.generic],
    y: npt.NDArray[np.int64],
    ids: npt.NDArray[np.generic],
    source: npt.NDArray[np.generic],
    salt: str,
    shards: int,
    slices: int,
) -> Data:
    """Assign rows to cells by the salted hash of ``source`` and sort them."""
    key = partition.keys(source.tolist(), salt)
    shard, slc = partition.assign(key, shards, slices)
    order = np.lexsort((key, slc, shard))
    values = ids.tolist()
    return Data(
        X[order],
        y[order],
        [values[i] for i in order],
        key[order],
        shard[order],
        slc[order],
    )


def stage_lineage(state: State) -> dict[str, frozenset[object]]:
    """Every stored adapter and stage head, and the ids it was trained on."""
    out: dict[str, frozenset[object]] = {}
    for (s, prefix), stage in sorted(state.stages.items()):
        base = f"shard{s}/prefix{list(prefix)}"
        for layer in sorted(stage.adapters):
            out[f"{base}/adapter/{layer}"] = stage.lineage
        out[f"{base}/head"] = stage.lineage
    if state.shared_lineage:
        out["backbone/buffers"] = state.shared_lineage
    return out


def stage_tensors(state: State) -> dict[str, Tensor]:
    """Every stored adapter and head tensor, by ``shard<s>/prefix<p>/...`` name."""
    out = {}
    for (s, prefix), stage in sorted(state.stages.items()):
        base = f"shard{s}/prefix{list(prefix)}"
        for layer, (a, b) in sorted(stage.adapters.items()):
            out[f"{base}/adapter/{layer}/A"], out[f"{base}/adapter/{layer}/B"] = a, b
        for name, tensor in sorted(stage.head.items()):
            out[f"{base}/head/{name}"] = tensor
    return out


def deletion_receipt(
    live: Sequence[Sequence[int]],
    orders: Sequence[Order],
    ids: tuple[object, ...],
    slots: tuple[Slot, ...],
    dropped: tuple[StageKey, ...],
    began: float,
) -> DeletionReceipt:
    """The receipt of a deletion that began at ``began`` (``perf_counter``)."""
    served = served_prefixes(live, orders)
    dead = tuple(s for s, p in enumerate(served) if not p)
    return DeletionReceipt(
        ids=ids,
        slots=slots,
        deactivated=dropped,
        served=served,
        dead_shards=dead,
        needs_retrain=bool(dead),
        all_dead=len(dead) == len(live),
        seconds=time.perf_counter() - began,
    )


def prefixes(orders: Sequence[Order]) -> list[Order]:
    """Every non-empty prefix of the orders (each trained stage), sorted."""
    return sorted({o[:k] for o in orders for k in range(1, len(o) + 1)})


def refilled_live(
    state: State, shards: Sequence[int], orders: Sequence[Order], slices: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[Slot, ...]]:
    """The live table after retraining ``shards``, and their empty cells.

    A retrained order serves up to its first empty cell (all of it if none): the
    stages whose prefix holds an empty cell are not trained, as a fresh fit refuses
    empty cells.
    """
    cells = state.data.empty_cells(len(state.live), slices)
    empty = tuple(c for c in cells if c[0] in shards)
    live = list(state.live)
    for s in shards:
        gaps = {j for t, j in empty if t == s}
        live[s] = tuple(
            next((i for i, j in enumerate(o) if j in gaps), slices) for o in orders
        )
    return tuple(live), empty
