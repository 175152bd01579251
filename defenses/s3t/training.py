"""Stage-wise training of one shard (Chowdhury et al., ICLR 2025, Algorithm 3).

For a slice order ``pi`` and a prefix ``pi_1 .. pi_k`` the stage model is trained on
the cumulative data ``S_{pi_1} u ... u S_{pi_k}``, starting from the stage ``k-1``
model of the same prefix:

* ``mode="slice"`` (S3T): only LoRA group ``k`` (groups counted from the top of the
  network) and the head are trained; groups ``1 .. k-1`` stay frozen, groups below
  ``k`` are still absent. So group ``k`` is a function of slices ``pi_1 .. pi_k`` only,
  and switching groups ``k ..`` off leaves exactly the stage ``k-1`` model.
* ``mode="all"`` (SISA, Bourtoule et al., 2021): every group and the head are trained
  at every stage; a stage is a checkpoint of the whole shard model.

Each stage has its own head and its own ``torch.Generator``, seeded by
``(seed, shard, prefix, mode)`` only, and a fresh optimizer: nothing a stage computes
depends on data outside its prefix. The model itself is a frozen copy of the user's
module (:class:`defenses.s3t.adapters.AdaptedModel`); adapters and heads are tensors
bound to it for each forward pass.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor

from defenses.checks import check_int, check_real
from defenses.s3t.adapters import AdaptedModel, LoRA
from defenses.threads import single_thread

Mode = Literal["slice", "all"]
Order = tuple[int, ...]
StageKey = tuple[int, Order]

__all__ = [
    "Mode",
    "Order",
    "ShardJob",
    "SliceData",
    "StageKey",
    "StageState",
    "TrainConfig",
    "served_model",
    "shard_probabilities",
    "single_thread",
    "slice_data",
    "stage_seed",
    "train_shard",
    "train_stage",
]


@dataclass(frozen=True)
class TrainConfig:
    """Optimization settings of every stage."""

    rank: int = 4
    epochs: int = 20
    batch_size: int = 64
    lr: float = 3e-3

    def __post_init__(self) -> None:
        for name in ("rank", "epochs", "batch_size"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        lr = check_real("lr", self.lr, 0.0, 1.0, open_low=True, open_high=True)
        object.__setattr__(self, "lr", lr)


@dataclass(frozen=True)
class SliceData:
    """The current contents of one slice, in key order."""

    X: Tensor
    y: Tensor
    ids: tuple[object, ...]


@dataclass(frozen=True)
class StageState:
    """What one stage trained: its adapters (by target layer), head and lineage."""

    adapters: Mapping[str, LoRA]
    head: Mapping[str, Tensor]
    lineage: frozenset[object]
    samples: int
    passes: int
    seconds: float


@dataclass(frozen=True)
class ShardJob:
    """Everything needed to train the missing stages of one shard."""

    shard: int
    prefixes: tuple[Order, ...]
    existing: Mapping[Order, StageState]
    slices: Mapping[int, SliceData]
    model: AdaptedModel
    groups: tuple[tuple[str, ...], ...]
    mode: Mode
    config: TrainConfig
    seed: int


def stage_seed(seed: int, shard: int, prefix: Order, mode: Mode) -> int:
    """Seed of one stage, a hash of ``(seed, shard, prefix, mode)`` only."""
    text = f"{seed}|{shard}|{','.join(map(str, prefix))}|{mode}"
    return (
        int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
        >> 1
    )


def served_model(
    stages: Mapping[Order, StageState], prefix: Order
) -> tuple[dict[str, LoRA], Mapping[str, Tensor]]:
    """Adapters and head of the model with ``prefix``: later stages override earlier."""
    adapters: dict[str, LoRA] = {}
    for k in range(1, len(prefix) + 1):
        adapters.update(stages[prefix[:k]].adapters)
    return adapters, stages[prefix].head


def shard_probabilities(
    model: AdaptedModel,
    stages: Mapping[Order, StageState],
    prefix: Order,
    X: Tensor,
) -> Tensor:
    """Class probabilities (float64 softmax) of the model one shard serves.

    Rows whose logits are not finite (finite features large enough that the model's
    forward pass overflows) have no probabilities: they are refused, naming ``X``.
    """
    adapters, head = served_model(stages, prefix)
    with torch.no_grad(), single_thread():
        logits = model.logits(X, adapters, head)
    finite = torch.isfinite(logits).all(dim=1)
    if not bool(finite.all()):
        bad = torch.nonzero(~finite).flatten()
        raise ValueError(
            f"X: the served model's logits hold NaN or inf on {bad.numel()} row(s) "
            f"(the first: row {int(bad[0])}); its forward pass overflows on these "
            "features: scale them as the training data were"
        )
    return torch.softmax(logits.double(), dim=1)


def _start(
    job: ShardJob,
    prefix: Order,
    stages: Mapping[Order, StageState],
    gen: torch.Generator,
) -> tuple[dict[str, LoRA], dict[str, LoRA], Mapping[str, Tensor]]:
    """Frozen adapters, initial trainable adapters and initial head of a stage."""
    model, k, rank = job.model, len(prefix), job.config.rank
    if job.mode == "slice":
        frozen, head = (
            served_model(stages, prefix[:-1]) if k > 1 else ({}, model.base_head)
        )
        return frozen, model.fresh(job.groups[k - 1], rank, gen), head
    if k > 1:
        parent = stages[prefix[:-1]]
        return {}, dict(parent.adapters), parent.head
    return {}, model.fresh(model.targets, rank, gen), model.base_head


def train_stage(
    job: ShardJob, prefix: Order, stages: Mapping[Order, StageState]
) -> StageState:
    """Train the stage of ``prefix``; its ancestors must be in ``stages``.

    Adam on the cross-entropy of the stage's cumulative data, ``epochs`` passes in
    mini-batches drawn by the stage's own generator; only the stage's adapters and
    its head receive updates.
    """
    began = time.perf_counter()
    gen = torch.Generator().manual_seed(
        stage_seed(job.seed, job.shard, prefix, job.mode)
    )
    frozen, init, head = _start(job, prefix, stages, gen)
    parts = [job.slices[j] for j in prefix]
    features = torch.cat([p.X for p in parts])
    labels = torch.cat([p.y for p in parts])
    lineage = frozenset(i for p in parts for i in p.ids)
    params = {
        t: (a.clone().requires_grad_(True), b.clone().requires_grad_(True))
        for t, (a, b) in init.items()
    }
    head_params = {n: t.detach().clone().requires_grad_(True) for n, t in head.items()}
    optimizer = torch.optim.Adam(
        [t for lora in params.values() for t in lora] + list(head_params.values()),
        lr=job.config.lr,
    )
    n = int(labels.numel())
    with job.model.bound({**frozen, **params}, head_params):
        for _ in range(job.config.epochs if n else 0):
            order = torch.randperm(n, generator=gen)
            for start in range(0, n, job.config.batch_size):
                batch = order[start : start + job.config.batch_size]
                optimizer.zero_grad()
                loss = F.cross_entropy(job.model.run(features[batch]), labels[batch])
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
    return StageState(
        adapters={t: (a.detach(), b.detach()) for t, (a, b) in params.items()},
        head={name: t.detach() for name, t in head_params.items()},
        lineage=lineage,
        samples=n,
        passes=n * job.config.epochs,
        seconds=time.perf_counter() - began,
    )


def train_shard(job: ShardJob) -> dict[Order, StageState]:
    """Train the stages of ``job.prefixes`` (shortest first); return the new ones."""
    stages: dict[Order, StageState] = dict(job.existing)
    new: dict[Order, StageState] = {}
    with single_thread():
        for prefix in sorted(job.prefixes, key=len):
            new[prefix] = stages[prefix] = train_stage(job, prefix, stages)
    return new


def slice_data(
    X: npt.NDArray[np.generic], y: npt.NDArray[np.int64], ids: Sequence[object]
) -> SliceData:
    """Pack one slice's rows (already in key order) as tensors."""
    return SliceData(torch.as_tensor(X), torch.as_tensor(y), tuple(ids))
