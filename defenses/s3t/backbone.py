r"""The frozen backbone and its LoRA adapters.

The backbone is a small pre-norm residual MLP (a stand-in for the transformer of
Chowdhury et al., ICLR 2025, "Towards Scalable Exact Machine Unlearning Using
Parameter-Efficient Fine-Tuning"):

.. math::

    h_0 = W_s x + b_s, \qquad
    h_{i+1} = h_i + W_{2,i}\,\mathrm{GELU}(W_{1,i}\,\mathrm{N}_i(h_i) + b_{1,i})
    + b_{2,i}, \qquad
    \mathrm{logits} = W_o\,\mathrm{N}(h_{n}) + b_o .

A LoRA adapter of rank ``r`` on a linear map ``W`` adds a low-rank update,
``W x -> W x + B (A x)`` with ``A`` of shape ``(r, in)`` drawn from
``N(0, 1/in)`` and ``B`` of shape ``(out, r)`` starting at zero (Hu et al., 2022), so
a fresh adapter leaves the network unchanged. Every block carries one adapter on
each of its two linear maps; adapters are held outside the module (plain tensors),
so that one frozen backbone serves every shard and stage.

``N_i`` is a LayerNorm by default. ``norm="batch"`` builds BatchNorm layers instead:
their running statistics are state shared by every stage, the leak that the
negative-control audit must catch.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Mapping
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from defenses.checks import check_int

Norm = Literal["layer", "batch"]
BlockLoRA = tuple[Tensor, Tensor, Tensor, Tensor]
"""Adapter of one block: ``(A1, B1, A2, B2)`` for its first and second linear map."""


class Block(nn.Module):
    """One pre-norm residual MLP block."""

    def __init__(self, width: int, hidden: int, norm: Norm) -> None:
        super().__init__()
        self.norm: nn.Module = (
            nn.LayerNorm(width) if norm == "layer" else nn.BatchNorm1d(width)
        )
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, h: Tensor, lora: BlockLoRA | None = None) -> Tensor:
        """Apply the block, with the adapter ``lora`` if given."""
        z: Tensor = self.norm(h)
        u: Tensor = self.fc1(z)
        if lora is not None:
            u = u + (z @ lora[0].T) @ lora[1].T
        u = F.gelu(u)
        v: Tensor = self.fc2(u)
        if lora is not None:
            v = v + (u @ lora[2].T) @ lora[3].T
        return h + v


class ResidualMLP(nn.Module):
    """A pre-norm residual MLP with a linear stem and a linear head.

    Parameters
    ----------
    in_dim, width, hidden, n_blocks, n_classes : int
        Input size, residual width, hidden width of each block, number of blocks and
        number of classes.
    norm : {"layer", "batch"}
        Normalization inside the blocks ("batch" only for the negative control).
    generator : torch.Generator or None
        Source of the initial weights (a fixed default seed if None).
    """

    def __init__(
        self,
        in_dim: int = 64,
        width: int = 96,
        hidden: int = 192,
        n_blocks: int = 6,
        n_classes: int = 10,
        norm: Norm = "layer",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("in_dim", in_dim),
            ("width", width),
            ("hidden", hidden),
            ("n_blocks", n_blocks),
            ("n_classes", n_classes),
        ):
            check_int(f"ResidualMLP.{name}", value, minimum=1)
        if n_classes < 2:
            raise ValueError(f"ResidualMLP.n_classes must be >= 2, got {n_classes}")
        if norm not in ("layer", "batch"):
            raise ValueError(
                f"ResidualMLP.norm must be 'layer' or 'batch', got {norm!r}"
            )
        self.in_dim, self.width, self.hidden = in_dim, width, hidden
        self.n_classes, self.norm_kind = n_classes, norm
        self.stem = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList(Block(width, hidden, norm) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, n_classes)
        gen = generator if generator is not None else torch.Generator().manual_seed(0)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    bound = 1.0 / math.sqrt(module.in_features)
                    module.weight.uniform_(-bound, bound, generator=gen)
                    module.bias.uniform_(-bound, bound, generator=gen)

    @property
    def n_blocks(self) -> int:
        """Number of residual blocks."""
        return len(self.blocks)

    def embed(self, x: Tensor, stop: int) -> Tensor:
        """Stem, then blocks ``0 .. stop-1`` without adapters."""
        h: Tensor = self.stem(x)
        for i in range(stop):
            h = self.blocks[i](h)
        return h

    def top(
        self,
        h: Tensor,
        start: int,
        adapters: Mapping[int, BlockLoRA],
        head: tuple[Tensor, Tensor],
    ) -> Tensor:
        """Blocks ``start ..`` with ``adapters`` (by block index), final norm, head."""
        for i in range(start, self.n_blocks):
            h = self.blocks[i](h, adapters.get(i))
        return F.linear(self.norm(h), head[0], head[1])

    def forward(self, x: Tensor) -> Tensor:
        """Logits of the plain backbone (no adapters, its own head)."""
        return self.top(self.embed(x, 0), 0, {}, (self.head.weight, self.head.bias))

    def has_shared_state(self) -> bool:
        """Whether training in train mode would update buffers (BatchNorm stats)."""
        return any(b.numel() > 0 for b in self.buffers())


def block_groups(n_blocks: int, n_groups: int) -> list[tuple[int, ...]]:
    """Split blocks into ``n_groups`` contiguous groups counted from the top.

    Group 0 holds the top blocks (trained first by S3T), group ``n_groups - 1`` the
    bottom ones; sizes differ by at most one (larger groups on top).

    >>> block_groups(6, 4)
    [(4, 5), (2, 3), (1,), (0,)]
    """
    check_int("n_groups", n_groups, minimum=1)
    if n_groups > n_blocks:
        raise ValueError(
            f"cannot split {n_blocks} blocks into {n_groups} groups; "
            f"slices must be <= the backbone's n_blocks ({n_blocks})"
        )
    top_down = list(range(n_blocks - 1, -1, -1))
    return [
        tuple(sorted(int(i) for i in g)) for g in np.array_split(top_down, n_groups)
    ]


def fresh_lora(width: int, hidden: int, rank: int, gen: torch.Generator) -> BlockLoRA:
    """A new block adapter: ``A ~ N(0, 1/in)``, ``B = 0`` (the identity update)."""
    a1 = torch.randn(rank, width, generator=gen) / math.sqrt(width)
    a2 = torch.randn(rank, hidden, generator=gen) / math.sqrt(hidden)
    return (a1, torch.zeros(hidden, rank), a2, torch.zeros(width, rank))


def fingerprint(backbone: nn.Module) -> str:
    """SHA-256 of the backbone's parameters and buffers (names, shapes, bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(backbone.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def frozen_copy(backbone: ResidualMLP) -> ResidualMLP:
    """A deep copy with every parameter frozen (``requires_grad=False``)."""
    clone = copy.deepcopy(backbone)
    clone.requires_grad_(False)
    return clone


def pretrain(
    X: npt.ArrayLike,
    y: npt.ArrayLike,
    rng: np.random.Generator,
    *,
    n_classes: int = 10,
    width: int = 96,
    hidden: int = 192,
    n_blocks: int = 6,
    epochs: int = 30,
    lr: float = 3e-3,
    batch_size: int = 64,
    norm: Norm = "layer",
) -> ResidualMLP:
    """Train a backbone on public data, then freeze it and put it in eval mode.

    The public split is treated as non-deletable: exactness of unlearning covers the
    fine-tuning data only.
    """
    features = torch.as_tensor(np.asarray(X, dtype=np.float32))
    labels = torch.as_tensor(np.asarray(y, dtype=np.int64))
    if features.ndim != 2 or labels.shape != (features.shape[0],) or len(labels) == 0:
        raise ValueError(
            f"pretrain needs X of shape (n, d) and y of shape (n,), n > 0; got "
            f"{tuple(features.shape)} and {tuple(labels.shape)}"
        )
    check_int("epochs", epochs, minimum=1)
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    model = ResidualMLP(
        features.shape[1], width, hidden, n_blocks, n_classes, norm, generator=gen
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for _ in range(epochs):
            order = torch.randperm(len(labels), generator=gen)
            for start in range(0, len(labels), batch_size):
                batch = order[start : start + batch_size]
                optimizer.zero_grad()
                loss = F.cross_entropy(model(features[batch]), labels[batch])
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return frozen_copy(model)
