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
depends on data outside its prefix. Blocks below the lowest trained group carry no
adapter and are frozen, so their output is computed once per slice (slice by slice,
so that it does not depend on other slices' contents).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor

from defenses.checks import check_int, check_real
from defenses.s3t.backbone import BlockLoRA, ResidualMLP, fresh_lora

Mode = Literal["slice", "all"]
Order = tuple[int, ...]
StageKey = tuple[int, Order]


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the block with one torch thread (tiny models are much faster so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class TrainConfig:
    """Optimization settings of every stage."""

    rank: int = 4
    epochs: int = 20
    batch_size: int = 64
    lr: float = 3e-3

    def __post_init__(self) -> None:
        for name in ("rank", "epochs", "batch_size"):
            check_int(name, getattr(self, name), minimum=1)
        check_real("lr", self.lr, 0.0, 1.0, open_low=True, open_high=True)


@dataclass(frozen=True)
class SliceData:
    """The current contents of one slice, in key order."""

    X: Tensor
    y: Tensor
    ids: tuple[object, ...]


@dataclass(frozen=True)
class StageState:
    """What one stage trained: its adapters (by block), its head, and its lineage."""

    adapters: Mapping[int, BlockLoRA]
    head: tuple[Tensor, Tensor]
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
    backbone: ResidualMLP
    groups: tuple[tuple[int, ...], ...]
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
) -> tuple[dict[int, BlockLoRA], tuple[Tensor, Tensor]]:
    """Adapters and head of the model with ``prefix``: later stages override earlier."""
    adapters: dict[int, BlockLoRA] = {}
    for k in range(1, len(prefix) + 1):
        adapters.update(stages[prefix[:k]].adapters)
    return adapters, stages[prefix].head


def shard_probabilities(
    backbone: ResidualMLP,
    stages: Mapping[Order, StageState],
    prefix: Order,
    X: Tensor,
) -> Tensor:
    """Class probabilities (float64 softmax) of the model one shard serves."""
    adapters, head = served_model(stages, prefix)
    with torch.no_grad(), single_thread():
        logits = backbone.top(backbone.embed(X, 0), 0, adapters, head)
    return torch.softmax(logits.double(), dim=1)


def train_stage(
    job: ShardJob, prefix: Order, stages: Mapping[Order, StageState]
) -> StageState:
    """Train the stage of ``prefix``; its ancestors must be in ``stages``."""
    began = time.perf_counter()
    bb, k, rank = job.backbone, len(prefix), job.config.rank
    gen = torch.Generator().manual_seed(
        stage_seed(job.seed, job.shard, prefix, job.mode)
    )
    if job.mode == "slice":
        trainable = job.groups[k - 1]
        frozen, head = (
            served_model(stages, prefix[:-1])
            if k > 1
            else ({}, (bb.head.weight, bb.head.bias))
        )
        init = {i: fresh_lora(bb.width, bb.hidden, rank, gen) for i in trainable}
    else:
        trainable = tuple(range(bb.n_blocks))
        frozen = {}
        if k > 1:
            parent = stages[prefix[:-1]]
            init, head = dict(parent.adapters), parent.head
        else:
            init = {i: fresh_lora(bb.width, bb.hidden, rank, gen) for i in trainable}
            head = (bb.head.weight, bb.head.bias)
    cut = min(trainable)
    if any(i < cut for i in frozen):
        raise RuntimeError(f"stage {prefix}: an adapter below the trained group {cut}")
    parts = [job.slices[j] for j in prefix]
    with torch.no_grad():
        feats = [bb.embed(p.X, cut) for p in parts if len(p.y)]
    features = torch.cat(feats) if feats else torch.empty(0, bb.width)
    labels = torch.cat([p.y for p in parts])
    lineage = frozenset(i for p in parts for i in p.ids)
    params = {
        i: tuple(t.clone().requires_grad_(True) for t in init[i]) for i in trainable
    }
    head_params = (
        head[0].detach().clone().requires_grad_(True),
        head[1].detach().clone().requires_grad_(True),
    )
    optimizer = torch.optim.Adam(
        [t for lora in params.values() for t in lora] + list(head_params),
        lr=job.config.lr,
    )
    adapters: dict[int, BlockLoRA] = {**frozen}
    n = int(labels.numel())
    for _ in range(job.config.epochs if n else 0):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, job.config.batch_size):
            batch = order[start : start + job.config.batch_size]
            adapters.update({i: (t[0], t[1], t[2], t[3]) for i, t in params.items()})
            optimizer.zero_grad()
            logits = bb.top(features[batch], cut, adapters, head_params)
            loss = F.cross_entropy(logits, labels[batch])
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    trained = {
        i: (t[0].detach(), t[1].detach(), t[2].detach(), t[3].detach())
        for i, t in params.items()
    }
    return StageState(
        adapters=trained,
        head=(head_params[0].detach(), head_params[1].detach()),
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
