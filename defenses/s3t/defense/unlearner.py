"""The engine of S3T, SISA and full retraining: fit, serve, delete, retrain.

See :mod:`defenses.s3t.defense` for the algorithm; :mod:`.state` holds the deletion
bookkeeping, :mod:`.persist` the state files' payload, :mod:`defenses.s3t.inputs`
the checks of what the user passes, :mod:`defenses.s3t.adapters` the user's model
with its adapters.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from defenses.arrays import FloatArray
from defenses.checks import check_int
from defenses.cost import count, phase
from defenses.s3t import inputs, partition, store
from defenses.s3t.adapters import Targets, fingerprint, target_groups, updating_stats
from defenses.s3t.backbone import adapt
from defenses.s3t.conformance import Conformance, check_unchanged
from defenses.s3t.defense.holder import StateHolder
from defenses.s3t.defense.state import (
    AllShardsDeadError,
    DeletionReceipt,
    RetrainReceipt,
    Slot,
    State,
    deletion_receipt,
    find_rows,
    forget_rows,
    partition_data,
    prefixes,
    refilled_live,
    served_prefixes,
    switch_off,
)
from defenses.s3t.parallel import EXECUTORS, Executor, run_jobs
from defenses.s3t.training import (
    Mode,
    Order,
    ShardJob,
    StageKey,
    StageState,
    TrainConfig,
    shard_probabilities,
)

logger = logging.getLogger(__name__)


def _slot(cell: object) -> Slot:
    """One ``(shard, slice)`` pair of integers (message names ``slots``)."""
    if not isinstance(cell, tuple | list) or len(cell) != 2:
        raise ValueError(f"slots must hold (shard, slice) pairs, got {cell!r}")
    return (check_int("slots: shard", cell[0]), check_int("slots: slice", cell[1]))


class Unlearner(StateHolder):
    """Sharded, sliced, staged LoRA training with exact deletion (shared engine).

    Use :class:`S3T`, :class:`SISA` or :class:`FullRetrain`; their parameters are
    documented on :class:`S3T`.
    """

    mode: ClassVar[Mode]

    def __init__(
        self,
        model: nn.Module,
        *,
        target_modules: Targets | None,
        head: str | None,
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
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}"
            )
        self.shards = check_int("shards", shards, minimum=1)
        self.slices = check_int("slices", slices, minimum=1)
        self.config = TrainConfig(rank, epochs, batch_size, lr)
        self.seed = check_int("seed", seed, 0)
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        self.executor = executor
        self.n_jobs = check_int("n_jobs", n_jobs, minimum=1)
        self.ray_address = ray_address
        self.orders: tuple[Order, ...] = tuple(tuple(int(j) for j in o) for o in orders)
        updating = updating_stats(model) if isinstance(model, nn.Module) else []
        self.shared_state = bool(updating)
        if self.shared_state and not allow_shared_state:
            raise ValueError(
                f"model: its normalization (BatchNorm) layers {updating[:4]} are in "
                "training mode and have buffers (running statistics) that every "
                "stage would update: a leak across deletions. Call model.eval() first "
                "(allow_shared_state=True only for the negative-control audit)"
            )
        if self.shared_state and executor != "serial":
            raise ValueError("a model with shared state needs executor='serial'")
        self.model = adapt(model, target_modules, head, self.shared_state)
        self.backbone: nn.Module = self.model.module
        self.groups = tuple(target_groups(self.model.targets, self.slices))
        self.fingerprint = fingerprint(self.backbone)
        self.salt = f"s3t-partition-{self.seed}"
        self.store = None if store_path is None else store.check_path(store_path)
        self._state: State | None = None

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
            "targets": list(self.model.targets),
            "head": self.model.head,
            "backbone": self.fingerprint,
        }

    def _inputs(self, X: npt.ArrayLike, state: State | None) -> torch.Tensor:
        shape = None if state is None else state.input_shape
        array = inputs.as_array(X, "X")
        sample = shape if shape is not None else tuple(array.shape[1:])
        tokens = self.model.vocabulary(sample) if array.ndim >= 2 else None
        return torch.as_tensor(inputs.model_inputs(array, shape, tokens))

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
        X : array of shape (n, ...)
            Fine-tuning inputs, as the model takes them (float features or images;
            integer token ids for a model with an ``nn.Embedding``).
        y : array of shape (n,)
            Class labels of any type (at least two classes); the model's logits
            must have one column per class.
        ids : array of shape (n,)
            Unique sample ids (integers or strings): the handles for deletion.
        groups : array of shape (n,) or None
            Partition key (e.g. a user id): samples of one group share a slice, so
            deleting a user touches one slice. The sample ids by default.

        Before training, a conformance pass (:mod:`defenses.s3t.conformance`)
        refuses a backbone whose forward is random (functional dropout) or whose
        state moves (parameters, buffers, plain attributes through containers,
        hooks' closures, class attributes and globals its code names, the global
        random generators) during S3T's first forward passes, a pass over every
        row and a training step, naming the cause and the state.
        """
        probe = Conformance(self.model, self.shared_state)
        with probe:  # sees S3T's first forward passes on the module, too
            features = self._inputs(X, None)
            n = features.shape[0]
            classes, labels = inputs.encode_labels(y, n)
            idx, source = inputs.fit_ids(ids, groups, n)
            if self.shards * self.slices > n:
                raise ValueError(
                    f"shards x slices = {self.shards * self.slices} exceeds the "
                    f"{n} samples; every slice needs data"
                )
            self.model.check(features[:2], classes.size, self.config.rank)
            probe.run(
                features[:8],
                torch.as_tensor(labels[:8]),
                self.config.rank,
                self.config.lr,
                features,
            )
        probe.verdict()
        data = partition_data(
            features.numpy(), labels, idx, source, self.salt, self.shards, self.slices
        )
        empty = data.empty_cells(self.shards, self.slices)
        if empty:
            raise ValueError(
                f"{len(empty)} (shard, slice) cells got no samples, e.g. {empty[:3]}: "
                f"too few samples ({n}) for {self.shards} shards x {self.slices} slices"
            )
        full = tuple(
            tuple(self.slices for _ in self.orders) for _ in range(self.shards)
        )
        shape = tuple(int(d) for d in features.shape[1:])
        state = State(data, {}, full, frozenset(), frozenset(), classes, shape)
        with phase("train"):
            stages, _ = self._train(state, range(self.shards))
        self._commit(
            dataclasses.replace(
                state, stages=stages, shared_lineage=self._shared(state, stages)
            )
        )
        return self

    def _shared(
        self, state: State, stages: Mapping[StageKey, StageState]
    ) -> frozenset[object]:
        if not self.shared_state:
            return frozenset()
        seen = frozenset(i for stage in stages.values() for i in stage.lineage)
        return state.shared_lineage | seen

    def _train(
        self, state: State, shards: Iterable[int]
    ) -> tuple[dict[StageKey, StageState], tuple[StageKey, ...]]:
        """Train every missing stage of ``shards`` whose prefix has no empty cell."""
        jobs = []
        for s in shards:
            empty = {j for j in range(self.slices) if not state.data.rows_of(s, j).size}
            existing = {p: st for (t, p), st in state.stages.items() if t == s}
            missing = tuple(
                p
                for p in prefixes(self.orders)
                if p not in existing and not empty.intersection(p)
            )
            if missing:
                jobs.append(
                    ShardJob(
                        shard=s,
                        prefixes=missing,
                        existing=existing,
                        slices=state.data.slices_of(s, self.slices),
                        model=self.model,
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
        return served_prefixes(self._require().live, self.orders)

    def _shard_proba(self, X: npt.ArrayLike) -> tuple[int, dict[int, torch.Tensor]]:
        """The number of rows of ``X`` and each serving shard's class probabilities.

        Shards are in ascending order; a dead shard (no live prefix) is absent. The
        probabilities are ``softmax`` of the served model's logits, in float64.
        """
        state = self._require()
        features = self._inputs(X, state)
        out: dict[int, torch.Tensor] = {}
        for s, prefix in enumerate(self.served()):
            if prefix:
                mine = {p: st for (t, p), st in state.stages.items() if t == s}
                out[s] = shard_probabilities(self.model, mine, prefix, features)
        return features.shape[0], out

    def predict_proba(self, X: npt.ArrayLike) -> FloatArray:
        """Class probabilities averaged over the shards that still serve.

        Columns follow :attr:`classes_`.
        """
        n, per_shard = self._shard_proba(X)
        if not per_shard:
            raise AllShardsDeadError(
                "every shard lost its models to deletions; call retrain() first"
            )
        total = torch.zeros(n, self.classes_.size, dtype=torch.float64)
        for proba in per_shard.values():
            total += proba
        return (total / len(per_shard)).numpy()

    def shard_predictions(self, X: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Each shard's predicted class index, shape ``(shards, n)``; -1: abstains.

        Row ``s`` is the arg-max (an index into :attr:`classes_`) of the model shard
        ``s`` serves (the same model :meth:`predict_proba` averages), a function of
        that shard's surviving data only. A shard whose every order lost its first
        slice has no model and abstains (-1); when every shard is dead all rows are
        -1 (no error, unlike :meth:`predict_proba`). These are the votes of a
        partitioned ensemble, e.g. the part classifiers of reliable conformal
        prediction (:mod:`defenses.composition.s3t_rps`).
        """
        n, per_shard = self._shard_proba(X)
        votes = np.full((self.shards, n), -1, dtype=np.int64)
        for s, proba in per_shard.items():
            votes[s] = np.argmax(proba.numpy(), axis=1)
        return votes

    def predict(self, X: npt.ArrayLike) -> npt.NDArray[np.generic]:
        """Predicted labels (from :attr:`classes_`)."""
        labels: npt.NDArray[np.generic] = self.classes_[
            np.argmax(self.predict_proba(X), axis=1)
        ]
        return labels

    # ------------------------------------------------------------------ delete
    def _rows(self, state: State, ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        return find_rows(state, partition.check_ids(ids).tolist(), self.salt)

    def locate(self, ids: npt.ArrayLike) -> tuple[Slot, ...]:
        """The (shard, slice) of each id."""
        state = self._require()
        rows = self._rows(state, ids)
        return tuple((int(state.data.shard[r]), int(state.data.slice[r])) for r in rows)

    def delete(self, ids: npt.ArrayLike) -> DeletionReceipt:
        """Forget ``ids``: erase their rows and every stage that saw them.

        Atomic: on any error (unknown or already deleted id, a failed save) the
        model, and its state file, are as they were.

        Raises
        ------
        UnknownIdError
            An id is unknown or already deleted (a ``KeyError`` and a
            ``ValueError``).
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
            new, dropped = switch_off(state, self.orders, slots)
            self._commit(forget_rows(new, rows, self.salt))
        count("deletions", len(deleted))
        receipt = deletion_receipt(
            self._require().live, self.orders, deleted, slots, dropped, began
        )
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
        cells = tuple(sorted({_slot(c) for c in slots}))
        for s, j in cells:
            if not (0 <= s < self.shards and 0 <= j < self.slices):
                raise ValueError(
                    f"slots: ({s}, {j}) out of range: {self.shards} shards x "
                    f"{self.slices} slices"
                )
        new, dropped = switch_off(state, self.orders, cells)
        self._commit(new)
        return deletion_receipt(new.live, self.orders, (), cells, dropped, began)

    # ------------------------------------------------------------------ retrain
    def retrain(self, only_dead: bool = False) -> RetrainReceipt:
        """Retrain the switched-off stages on the surviving data.

        Afterwards the model equals, bit for bit, a fresh :meth:`fit` on the
        surviving data with the same seed (the partition and the stage seeds do not
        depend on the removed points). ``only_dead`` retrains only shards that have
        no model left. A (shard, slice) cell that deletions emptied is refused as a
        fresh fit refuses it: no stage whose prefix holds it is trained, each order
        of its shard serves only the slices before it, and a shard whose every order
        starts at an empty cell abstains; the receipt lists both, and a warning is
        logged.
        """
        if not isinstance(only_dead, bool | np.bool_):
            raise TypeError(f"only_dead must be a bool, got {only_dead!r}")
        state = self._require()
        check_unchanged(self.model, "retrain()", self.shared_state)
        began = time.perf_counter()
        served = self.served()
        shards = [s for s in range(self.shards) if not (only_dead and served[s])]
        with phase("retrain"):
            stages, trained = self._train(state, shards)
        live, empty = refilled_live(state, shards, self.orders, self.slices)
        new = dataclasses.replace(
            state,
            stages=stages,
            live=live,
            shared_lineage=self._shared(state, stages),
        )
        self._commit(new)
        abstaining = tuple(
            s for s, p in enumerate(served_prefixes(new.live, self.orders)) if not p
        )
        if empty:
            logger.warning(
                "retrain: cells %s are empty after deletions; their stages are not "
                "trained (a fresh fit refuses empty cells); abstaining shards: %s",
                list(empty),
                list(abstaining),
            )
        return RetrainReceipt(
            stages=trained,
            passes=sum(stages[k].passes for k in trained),
            seconds=time.perf_counter() - began,
            empty=empty,
            abstaining=abstaining,
        )
