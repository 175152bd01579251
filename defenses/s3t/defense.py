r"""S3T: exact unlearning with sequence-aware sharded sliced training.

Chowdhury, Choromanski, Sehanobish, Dubey, Chaturvedi, "Towards Scalable Exact
Machine Unlearning Using Parameter-Efficient Fine-Tuning", ICLR 2025
(arXiv:2406.16257).

The fine-tuning data are split into ``m`` shards of ``L`` slices each (by a salted
hash of the sample ids, so removing a point never moves another). A frozen backbone
gets ``L`` groups of LoRA adapters, counted from the top. For each of ``B`` slice
orders ``pi`` per shard, stage ``k`` trains adapter group ``k`` and a stage head on
``S_{pi_1} u ... u S_{pi_k}`` (see :mod:`defenses.s3t.training`); stages are cached
by ordered prefix.

Deleting a point of slice ``j`` switches off, in every order of its shard, the stages
from the position of ``j`` on, and erases their tensors: what is left of an order is
exactly its stage ``pos(j) - 1`` model, a function of data without the point. Each
shard serves the surviving model with the longest prefix; the shards' class
probabilities are averaged. The served system is thus a data-independent
post-processing of ``A(D \ {x})`` (exact unlearning in the sense of Cao and Yang,
2015, and Bourtoule et al., 2021); :meth:`Unlearner.retrain` brings it back to
exactly ``A(D \ {x})``, bit for bit, by retraining the switched-off stages.

Expected deletions before every shard is dead (uniform deletions, cyclic orders):
``m L H_{m B'}`` with ``B' = min(B, L)``, against ``m L H_m`` for SISA
(:mod:`defenses.s3t.sequences`).

:class:`S3T` is the method; the baselines with the same API, SISA and full
retraining, are in :mod:`defenses.s3t.baselines`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import torch

from defenses.checks import check_int
from defenses.cost import count, phase
from defenses.s3t import partition, store
from defenses.s3t.backbone import ResidualMLP, block_groups, fingerprint, frozen_copy
from defenses.s3t.parallel import EXECUTORS, Executor, run_jobs
from defenses.s3t.sequences import bms_orders, cyclic_orders
from defenses.s3t.training import (
    Mode,
    Order,
    ShardJob,
    SliceData,
    StageKey,
    StageState,
    TrainConfig,
    served_model,
    single_thread,
    slice_data,
)

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
Selection = Literal["cyclic", "bms"]
Slot = tuple[int, int]
FORMAT = 1


class NotFittedError(RuntimeError):
    """The model was used before :meth:`Unlearner.fit`."""


class AllShardsDeadError(RuntimeError):
    """Every shard lost its models to deletions: :meth:`Unlearner.retrain` first."""


@dataclass(frozen=True)
class _Data:
    """The surviving fine-tuning data, sorted by (shard, slice, key)."""

    X: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64]
    ids: list[object]
    key: npt.NDArray[np.uint64]
    shard: npt.NDArray[np.uint64]
    slice: npt.NDArray[np.uint64]

    def without(self, rows: npt.NDArray[np.int64]) -> _Data:
        keep = np.ones(len(self.ids), dtype=bool)
        keep[rows] = False
        return _Data(
            self.X[keep],
            self.y[keep],
            [v for v, k in zip(self.ids, keep, strict=True) if k],
            self.key[keep],
            self.shard[keep],
            self.slice[keep],
        )


@dataclass(frozen=True)
class _State:
    data: _Data
    stages: Mapping[StageKey, StageState]
    live: tuple[tuple[int, ...], ...]
    tombstones: frozenset[bytes]
    shared_lineage: frozenset[object]


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
    """What a retraining did: stages trained, sample-gradient passes, wall time."""

    stages: tuple[StageKey, ...]
    passes: int
    seconds: float


class Unlearner:
    """Sharded, sliced, staged LoRA training with exact deletion (shared engine).

    Use :class:`S3T`, :class:`SISA` or :class:`FullRetrain`.
    """

    mode: ClassVar[Mode]

    def __init__(
        self,
        backbone: ResidualMLP,
        *,
        shards: int,
        slices: int,
        orders: Sequence[Order],
        rank: int,
        epochs: int,
        batch_size: int,
        lr: float,
        seed: int,
        executor: Executor,
        n_jobs: int,
        ray_address: str | None,
        store_path: str | os.PathLike[str] | None,
        allow_shared_state: bool,
    ) -> None:
        if not isinstance(backbone, ResidualMLP):
            raise ValueError(
                f"backbone must be a defenses.s3t.backbone.ResidualMLP, got "
                f"{type(backbone).__name__}"
            )
        self.shards = check_int("shards", shards, minimum=1)
        self.slices = check_int("slices", slices, minimum=1)
        self.groups = tuple(block_groups(backbone.n_blocks, slices))
        self.config = TrainConfig(rank, epochs, batch_size, lr)
        check_int("seed", seed, 0)
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        self.seed, self.executor = seed, executor
        self.n_jobs = check_int("n_jobs", n_jobs, minimum=1)
        self.ray_address = ray_address
        self.orders: tuple[Order, ...] = tuple(tuple(int(j) for j in o) for o in orders)
        self.shared_state = backbone.training and backbone.has_shared_state()
        if self.shared_state and not allow_shared_state:
            raise ValueError(
                "the backbone is in training mode and has buffers (BatchNorm running "
                "statistics) that every stage would update: a leak across deletions. "
                "Call backbone.eval() first (allow_shared_state=True only for the "
                "negative-control audit)"
            )
        if self.shared_state and executor != "serial":
            raise ValueError("a backbone with shared state needs executor='serial'")
        self.backbone = frozen_copy(backbone)
        self.fingerprint = fingerprint(self.backbone)
        self.salt = f"s3t-partition-{seed}"
        self.store = None if store_path is None else os.fspath(store_path)
        self._state: _State | None = None

    # ------------------------------------------------------------------ config
    def _config(self) -> dict[str, Any]:
        return {
            "class": type(self).__name__,
            "mode": self.mode,
            "shards": self.shards,
            "slices": self.slices,
            "orders": [list(o) for o in self.orders],
            "train": dataclasses.asdict(self.config),
            "seed": self.seed,
            "backbone": self.fingerprint,
        }

    @property
    def fitted(self) -> bool:
        """Whether :meth:`fit` has run."""
        return self._state is not None

    def _require(self) -> _State:
        if self._state is None:
            raise NotFittedError(
                f"this {type(self).__name__} is not fitted; call fit first"
            )
        return self._state

    # ------------------------------------------------------------------ input
    def _features(self, X: npt.ArrayLike) -> npt.NDArray[np.float32]:
        array = np.asarray(X, dtype=np.float64)
        if array.ndim != 2 or array.shape[1] != self.backbone.in_dim:
            raise ValueError(
                f"X must have shape (n, {self.backbone.in_dim}), got {array.shape}"
            )
        if array.shape[0] == 0:
            raise ValueError("X is empty")
        if not np.all(np.isfinite(array)):
            raise ValueError("X must be finite (found NaN or inf)")
        return array.astype(np.float32)

    def _labels(self, y: npt.ArrayLike, n: int) -> npt.NDArray[np.int64]:
        array = np.asarray(y)
        if array.shape != (n,):
            raise ValueError(f"y must have shape ({n},), got {array.shape}")
        if array.dtype.kind not in "iu":
            raise ValueError(f"y must hold integer labels, got dtype {array.dtype}")
        k = self.backbone.n_classes
        if array.min() < 0 or array.max() >= k:
            raise ValueError(
                f"labels must lie in [0, {k}), got [{array.min()}, {array.max()}]"
            )
        return array.astype(np.int64)

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        X: npt.ArrayLike,
        y: npt.ArrayLike,
        ids: npt.ArrayLike,
        groups: npt.ArrayLike | None = None,
    ) -> Unlearner:
        """Partition the data and train every stage of every order of every shard.

        Parameters
        ----------
        X : array of shape (n, d)
            Fine-tuning features.
        y : array of shape (n,)
            Integer labels.
        ids : array of shape (n,)
            Unique sample ids (integers or strings): the handles for deletion.
        groups : array of shape (n,) or None
            Partition key (e.g. a user id): samples of one group share a slice, so
            deleting a user touches one slice. The sample ids by default.
        """
        features = self._features(X)
        n = features.shape[0]
        labels = self._labels(y, n)
        idx = partition.check_ids(ids)
        if idx.shape != (n,):
            raise ValueError(f"ids must have shape ({n},), got {idx.shape}")
        values, counts = np.unique(idx, return_counts=True)
        if np.any(counts > 1):
            raise ValueError(f"duplicate ids at fit: {values[counts > 1][:5].tolist()}")
        if self.shards * self.slices > n:
            raise ValueError(
                f"shards x slices = {self.shards * self.slices} exceeds the "
                f"{n} samples; every slice needs data"
            )
        source = idx if groups is None else partition.check_ids(groups, "groups")
        if source.shape != (n,):
            raise ValueError(f"groups must have shape ({n},), got {source.shape}")
        key = partition.keys(source.tolist(), self.salt)
        shard, slc = partition.assign(key, self.shards, self.slices)
        order = np.lexsort((key, slc, shard))
        data = _Data(
            features[order],
            labels[order],
            [idx.tolist()[i] for i in order],
            key[order],
            shard[order],
            slc[order],
        )
        filled = {(int(s), int(j)) for s, j in zip(data.shard, data.slice, strict=True)}
        empty = [
            (s, j)
            for s in range(self.shards)
            for j in range(self.slices)
            if (s, j) not in filled
        ]
        if empty:
            raise ValueError(
                f"{len(empty)} (shard, slice) cells got no samples, e.g. {empty[:3]}: "
                f"too few samples ({n}) for {self.shards} shards x {self.slices} slices"
            )
        full = tuple(
            tuple(self.slices for _ in self.orders) for _ in range(self.shards)
        )
        state = _State(data, {}, full, frozenset(), frozenset())
        with phase("train"):
            stages, _ = self._train(state, range(self.shards))
        self._commit(
            dataclasses.replace(
                state, stages=stages, shared_lineage=self._shared(state, stages)
            )
        )
        return self

    def _shared(
        self, state: _State, stages: Mapping[StageKey, StageState]
    ) -> frozenset[object]:
        if not self.shared_state:
            return frozenset()
        seen = frozenset(i for stage in stages.values() for i in stage.lineage)
        return state.shared_lineage | seen

    def _slices_of(self, data: _Data, shard: int) -> dict[int, SliceData]:
        out = {}
        for j in range(self.slices):
            rows = np.flatnonzero((data.shard == shard) & (data.slice == j))
            out[j] = slice_data(data.X[rows], data.y[rows], [data.ids[r] for r in rows])
        return out

    def _prefixes(self) -> list[Order]:
        return sorted({o[:k] for o in self.orders for k in range(1, self.slices + 1)})

    def _train(
        self, state: _State, shards: Iterable[int]
    ) -> tuple[dict[StageKey, StageState], tuple[StageKey, ...]]:
        jobs = []
        for s in shards:
            existing = {p: st for (t, p), st in state.stages.items() if t == s}
            missing = tuple(p for p in self._prefixes() if p not in existing)
            if not missing:
                continue
            for j in range(self.slices):
                if not np.any((state.data.shard == s) & (state.data.slice == j)):
                    logger.warning(
                        "shard %d slice %d is empty; its stages do not train", s, j
                    )
            jobs.append(
                ShardJob(
                    shard=s,
                    prefixes=missing,
                    existing=existing,
                    slices=self._slices_of(state.data, s),
                    backbone=self.backbone,
                    groups=self.groups,
                    mode=self.mode,
                    config=self.config,
                    seed=self.seed,
                )
            )
        results = run_jobs(jobs, self.executor, self.n_jobs, self.ray_address)
        stages = dict(state.stages)
        trained = []
        for job, new in zip(jobs, results, strict=True):
            for prefix, stage in new.items():
                stages[(job.shard, prefix)] = stage
                trained.append((job.shard, prefix))
                count("stages_trained")
                count("sample_passes", stage.passes)
        return stages, tuple(trained)

    # ------------------------------------------------------------------ serve
    def served(self) -> tuple[Order, ...]:
        """The prefix each shard serves (longest live prefix; empty if dead)."""
        state = self._require()
        out = []
        for s in range(self.shards):
            lengths = state.live[s]
            best = int(np.argmax(lengths))
            out.append(self.orders[best][: lengths[best]])
        return tuple(out)

    def _shard_proba(self, X: npt.ArrayLike) -> tuple[int, dict[int, torch.Tensor]]:
        """The number of rows of ``X`` and each serving shard's class probabilities.

        Shards are in ascending order; a dead shard (no live prefix) is absent. The
        probabilities are ``softmax`` of the served model's logits, in float64.
        """
        state = self._require()
        features = torch.as_tensor(self._features(X))
        alive = [(s, p) for s, p in enumerate(self.served()) if p]
        out: dict[int, torch.Tensor] = {}
        if not alive:
            return features.shape[0], out
        with torch.no_grad(), single_thread():
            embedded = self.backbone.embed(features, 0)
            for s, prefix in alive:
                shard_stages = {p: st for (t, p), st in state.stages.items() if t == s}
                adapters, head = served_model(shard_stages, prefix)
                logits = self.backbone.top(embedded, 0, adapters, head)
                out[s] = torch.softmax(logits.double(), dim=1)
        return features.shape[0], out

    def predict_proba(self, X: npt.ArrayLike) -> FloatArray:
        """Class probabilities averaged over the shards that still serve."""
        n, per_shard = self._shard_proba(X)
        if not per_shard:
            raise AllShardsDeadError(
                "every shard lost its models to deletions; call retrain() first"
            )
        total = torch.zeros(n, self.backbone.n_classes, dtype=torch.float64)
        for proba in per_shard.values():
            total += proba
        return (total / len(per_shard)).numpy()

    def shard_predictions(self, X: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Each shard's predicted class, shape ``(shards, n)``; -1 for a dead shard.

        Row ``s`` is the arg-max of the model shard ``s`` serves (the same model
        :meth:`predict_proba` averages), a function of that shard's surviving data
        only. A shard whose every order lost its first slice to deletions has no
        model and abstains (-1); when every shard is dead all rows are -1 (no error,
        unlike :meth:`predict_proba`). These are the votes of a partitioned ensemble,
        e.g. the part classifiers of reliable conformal prediction
        (:mod:`defenses.composition.s3t_rps`).
        """
        n, per_shard = self._shard_proba(X)
        votes = np.full((self.shards, n), -1, dtype=np.int64)
        for s, proba in per_shard.items():
            votes[s] = np.argmax(proba.numpy(), axis=1)
        return votes

    def predict(self, X: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Predicted labels."""
        labels: npt.NDArray[np.int64] = np.argmax(self.predict_proba(X), axis=1)
        return labels.astype(np.int64)

    # ------------------------------------------------------------------ delete
    def _rows(self, state: _State, ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        request = partition.check_ids(ids)
        if request.size == 0:
            raise ValueError("no ids given to delete")
        values = request.tolist()
        if len(set(values)) != len(values):
            raise ValueError("duplicate ids in one deletion request")
        where = {v: i for i, v in enumerate(state.data.ids)}
        rows = []
        for v in values:
            if v in where:
                rows.append(where[v])
            elif partition.digest(v, self.salt) in state.tombstones:
                raise KeyError(f"id {v!r} was already deleted")
            else:
                raise KeyError(f"unknown id {v!r}: it was never trained on")
        return np.asarray(rows, dtype=np.int64)

    def locate(self, ids: npt.ArrayLike) -> tuple[Slot, ...]:
        """The (shard, slice) of each id."""
        state = self._require()
        rows = self._rows(state, ids)
        return tuple((int(state.data.shard[r]), int(state.data.slice[r])) for r in rows)

    def _switch_off(
        self, state: _State, slots: Iterable[Slot]
    ) -> tuple[_State, tuple[StageKey, ...]]:
        live = [list(row) for row in state.live]
        hit = set(slots)
        for s, j in hit:
            for o, order in enumerate(self.orders):
                live[s][o] = min(live[s][o], order.index(j))
        dropped = tuple(
            sorted(
                k for k in state.stages if any(k[0] == s and j in k[1] for s, j in hit)
            )
        )
        stages = {k: v for k, v in state.stages.items() if k not in dropped}
        new = dataclasses.replace(
            state, stages=stages, live=tuple(tuple(row) for row in live)
        )
        return new, dropped

    def _receipt(
        self,
        ids: tuple[object, ...],
        slots: tuple[Slot, ...],
        dropped: tuple[StageKey, ...],
        began: float,
    ) -> DeletionReceipt:
        served = self.served()
        dead = tuple(s for s, p in enumerate(served) if not p)
        return DeletionReceipt(
            ids=ids,
            slots=slots,
            deactivated=dropped,
            served=served,
            dead_shards=dead,
            needs_retrain=bool(dead),
            all_dead=len(dead) == self.shards,
            seconds=time.perf_counter() - began,
        )

    def delete(self, ids: npt.ArrayLike) -> DeletionReceipt:
        """Forget ``ids``: erase their rows and every stage that saw them.

        Atomic: on any error (unknown or already deleted id, a failed save) the
        model, and its state file, are as they were.

        Raises
        ------
        KeyError
            An id is unknown or already deleted.
        """
        began = time.perf_counter()
        with phase("unlearn"):
            state = self._require()
            rows = self._rows(state, ids)
            slots = tuple(
                sorted(
                    {(int(state.data.shard[r]), int(state.data.slice[r])) for r in rows}
                )
            )
            deleted = tuple(state.data.ids[r] for r in rows)
            new, dropped = self._switch_off(state, slots)
            new = dataclasses.replace(
                new,
                data=state.data.without(rows),
                tombstones=state.tombstones
                | {partition.digest(v, self.salt) for v in deleted},
            )
            self._commit(new)
        count("deletions", len(deleted))
        receipt = self._receipt(deleted, slots, dropped, began)
        logger.info(
            "deleted %d ids; %d stages off; dead shards %s",
            len(deleted),
            len(dropped),
            receipt.dead_shards,
        )
        return receipt

    def deactivate(self, slots: Iterable[Slot]) -> DeletionReceipt:
        """Switch off every stage trained on the given (shard, slice) cells.

        No data are removed: this is the operator ``Deact_j`` of the exactness audit
        (a twin trained without a point is deactivated at the point's slice).
        """
        began = time.perf_counter()
        state = self._require()
        cells = tuple(sorted({(int(s), int(j)) for s, j in slots}))
        for s, j in cells:
            if not (0 <= s < self.shards and 0 <= j < self.slices):
                raise ValueError(
                    f"slot ({s}, {j}) out of range: {self.shards} shards x "
                    f"{self.slices} slices"
                )
        new, dropped = self._switch_off(state, cells)
        self._commit(new)
        return self._receipt((), cells, dropped, began)

    # ------------------------------------------------------------------ retrain
    def retrain(self, only_dead: bool = False) -> RetrainReceipt:
        """Retrain the switched-off stages on the surviving data.

        Afterwards the model equals, bit for bit, a fresh :meth:`fit` on the
        surviving data with the same seed (the partition and the stage seeds do not
        depend on the removed points). ``only_dead`` retrains only shards that have
        no model left.
        """
        state = self._require()
        began = time.perf_counter()
        served = self.served()
        shards = [s for s in range(self.shards) if not (only_dead and served[s])]
        with phase("retrain"):
            stages, trained = self._train(state, shards)
        live = tuple(
            tuple(self.slices for _ in self.orders) if s in shards else state.live[s]
            for s in range(self.shards)
        )
        new = dataclasses.replace(
            state, stages=stages, live=live, shared_lineage=self._shared(state, stages)
        )
        self._commit(new)
        return RetrainReceipt(
            stages=trained,
            passes=sum(stages[k].passes for k in trained),
            seconds=time.perf_counter() - began,
        )

    # ------------------------------------------------------------------ audit
    def lineage(self) -> dict[str, frozenset[object]]:
        """Every stored parameter group and stage head, and the ids it was trained on.

        Keys are ``shard<s>/prefix<p>/block<i>`` (an adapter) and
        ``shard<s>/prefix<p>/head``; ``backbone/buffers`` appears when the backbone
        has shared state updated by training (the leak the audit must catch).
        """
        state = self._require()
        out: dict[str, frozenset[object]] = {}
        for (s, prefix), stage in sorted(state.stages.items()):
            base = f"shard{s}/prefix{list(prefix)}"
            for block in sorted(stage.adapters):
                out[f"{base}/block{block}"] = stage.lineage
            out[f"{base}/head"] = stage.lineage
        if state.shared_lineage:
            out["backbone/buffers"] = state.shared_lineage
        return out

    def active_state(self) -> dict[str, torch.Tensor]:
        """Every tensor the model holds: backbone, stored adapters and heads."""
        state = self._require()
        out = {f"backbone/{k}": v for k, v in self.backbone.state_dict().items()}
        for (s, prefix), stage in sorted(state.stages.items()):
            base = f"shard{s}/prefix{list(prefix)}"
            for block, lora in sorted(stage.adapters.items()):
                for name, tensor in zip(("A1", "B1", "A2", "B2"), lora, strict=True):
                    out[f"{base}/block{block}/{name}"] = tensor
            out[f"{base}/head/weight"], out[f"{base}/head/bias"] = stage.head
        return out

    def stages(self) -> Mapping[StageKey, StageState]:
        """The stored stages by (shard, prefix) (read-only)."""
        return MappingProxyType(dict(self._require().stages))

    def training_seconds(self) -> tuple[float, ...]:
        """Wall time spent training each shard's stored stages."""
        state = self._require()
        per = [0.0] * self.shards
        for (s, _), stage in state.stages.items():
            per[s] += stage.seconds
        return tuple(per)

    def training_ids(self) -> frozenset[object]:
        """The ids of the surviving fine-tuning data."""
        return frozenset(self._require().data.ids)

    # ------------------------------------------------------------------ persist
    def _commit(self, state: _State) -> None:
        if self.store is not None:
            store.write_atomic(self.store, store.encode(self._payload(state)))
        self._state = state

    def _payload(self, state: _State) -> dict[str, Any]:
        stages = {}
        for (s, prefix), stage in state.stages.items():
            stages[f"{s}:{','.join(map(str, prefix))}"] = {
                "adapters": {str(b): list(t) for b, t in stage.adapters.items()},
                "head": list(stage.head),
                "lineage": sorted(stage.lineage, key=partition.id_token),
                "samples": stage.samples,
                "passes": stage.passes,
                "seconds": stage.seconds,
            }
        data = state.data
        return {
            "format": FORMAT,
            "config": self._config(),
            "X": torch.as_tensor(data.X),
            "y": torch.as_tensor(data.y),
            "ids": list(data.ids),
            "key": torch.as_tensor(data.key.view(np.int64)),
            "stages": stages,
            "live": [list(row) for row in state.live],
            "tombstones": sorted(t.hex() for t in state.tombstones),
            "shared_lineage": sorted(state.shared_lineage, key=partition.id_token),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the state atomically to ``path``."""
        store.write_atomic(path, store.encode(self._payload(self._require())))

    def load(self, path: str | os.PathLike[str]) -> Unlearner:
        """Replace the state by the one saved at ``path``.

        Raises
        ------
        StateFileError
            The file is corrupted or was saved by a model with another class,
            configuration or backbone. The model is left as it was.
        """
        payload = store.read(path)
        try:
            state = self._decode(payload)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            if isinstance(error, store.StateFileError):
                raise
            raise store.StateFileError(
                f"{path}: malformed state ({error!r})"
            ) from error
        self._state = state
        return self

    def _decode(self, payload: Mapping[str, Any]) -> _State:
        if payload.get("format") != FORMAT:
            raise store.StateFileError(
                f"state format {payload.get('format')!r}, expected {FORMAT}"
            )
        saved, mine = payload["config"], self._config()
        diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        if diff:
            raise store.StateFileError(
                "the state file does not match this model: "
                + "; ".join(
                    f"{k}: saved {saved.get(k)!r}, here {mine.get(k)!r}" for k in diff
                )
            )
        key = payload["key"].numpy().view(np.uint64).copy()
        shard, slc = partition.assign(key, self.shards, self.slices)
        data = _Data(
            payload["X"].numpy().copy(),
            payload["y"].numpy().copy(),
            list(payload["ids"]),
            key,
            shard,
            slc,
        )
        if not (len(data.ids) == len(data.y) == len(data.X) == len(key)):
            raise ValueError("data arrays of different lengths")
        stages: dict[StageKey, StageState] = {}
        for name, raw in payload["stages"].items():
            s, _, text = name.partition(":")
            prefix = tuple(int(j) for j in text.split(","))
            stages[(int(s), prefix)] = StageState(
                adapters={
                    int(b): (t[0], t[1], t[2], t[3]) for b, t in raw["adapters"].items()
                },
                head=(raw["head"][0], raw["head"][1]),
                lineage=frozenset(raw["lineage"]),
                samples=int(raw["samples"]),
                passes=int(raw["passes"]),
                seconds=float(raw["seconds"]),
            )
        live = tuple(tuple(int(v) for v in row) for row in payload["live"])
        if len(live) != self.shards or any(len(r) != len(self.orders) for r in live):
            raise ValueError("live prefix table has the wrong shape")
        return _State(
            data,
            stages,
            live,
            frozenset(bytes.fromhex(t) for t in payload["tombstones"]),
            frozenset(payload["shared_lineage"]),
        )


class S3T(Unlearner):
    """Sequence-aware sharded sliced training (Chowdhury et al., ICLR 2025).

    Parameters
    ----------
    backbone : ResidualMLP
        The frozen pretrained backbone (copied; put it in eval mode).
    shards, slices : int
        ``m`` shards of ``L`` slices; ``L`` at most the backbone's number of blocks.
    sequences : int or None
        Budget ``B`` of slice orders per shard (``L`` if None).
    rank : int
        LoRA rank.
    selection : {"cyclic", "bms"}
        Order selection: cyclic rotation, or bipartite matching on ``slice_prior``.
    slice_prior : sequence of float or None
        Deletion probability of each slice index (BMS only; uniform if None).
    epochs, batch_size, lr : int, int, float
        Adam settings of every stage.
    seed : int
        Seeds the partition and every stage.
    executor : {"serial", "process", "ray"}
        Where shards train (in parallel except "serial"); ``n_jobs`` workers;
        ``ray_address`` of a Ray cluster (local Ray if None).
    store : path or None
        If given, every fit, deletion and retraining is saved there atomically.
    allow_shared_state : bool
        Accept a backbone whose buffers training updates (negative control only).
    """

    mode: ClassVar[Mode] = "slice"

    def __init__(
        self,
        backbone: ResidualMLP,
        shards: int = 3,
        slices: int = 3,
        sequences: int | None = None,
        rank: int = 4,
        selection: Selection = "cyclic",
        *,
        slice_prior: Sequence[float] | None = None,
        epochs: int = 20,
        batch_size: int = 64,
        lr: float = 3e-3,
        seed: int = 0,
        executor: Executor = "serial",
        n_jobs: int = 1,
        ray_address: str | None = None,
        store: str | os.PathLike[str] | None = None,
        allow_shared_state: bool = False,
    ) -> None:
        budget = (
            check_int("slices", slices, minimum=1) if sequences is None else sequences
        )
        check_int("sequences", budget, minimum=1)
        if selection == "cyclic":
            if slice_prior is not None:
                raise ValueError("slice_prior is used by selection='bms' only")
            orders = cyclic_orders(slices, budget)
        elif selection == "bms":
            prior = (
                np.full(slices, 1.0 / slices) if slice_prior is None else slice_prior
            )
            if len(prior) != slices:
                raise ValueError(
                    f"slice_prior must have one value per slice ({slices}), "
                    f"got {len(prior)}"
                )
            orders = bms_orders(prior, budget)
        else:
            raise ValueError(f"selection must be 'cyclic' or 'bms', got {selection!r}")
        self.sequences, self.selection = budget, selection
        super().__init__(
            backbone,
            shards=shards,
            slices=slices,
            orders=orders,
            rank=rank,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            executor=executor,
            n_jobs=n_jobs,
            ray_address=ray_address,
            store_path=store,
            allow_shared_state=allow_shared_state,
        )
