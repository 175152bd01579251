r"""The suite's demo backbone: a small pre-norm residual MLP, and its pretraining.

The backbone is a small pre-norm residual MLP (a stand-in for the transformer of
Chowdhury et al., ICLR 2025, "Towards Scalable Exact Machine Unlearning Using
Parameter-Efficient Fine-Tuning"):

.. math::

    h_0 = W_s x + b_s, \qquad
    h_{i+1} = h_i + W_{2,i}\,\mathrm{GELU}(W_{1,i}\,\mathrm{N}_i(h_i) + b_{1,i})
    + b_{2,i}, \qquad
    \mathrm{logits} = W_o\,\mathrm{N}(h_{n}) + b_o .

S3T puts its adapters on both linear maps of every block by default
(:meth:`ResidualMLP.default_targets`) and trains the ``head`` at every stage; any
other ``nn.Module`` works the same way with its own ``target_modules``
(:mod:`defenses.s3t.adapters`).

``N_i`` is a LayerNorm by default. ``norm="batch"`` builds BatchNorm layers instead:
their running statistics are state shared by every stage, the leak that the
negative-control audit must catch.
"""

from __future__ import annotations

import copy
import math
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from defenses.checks import check_int, check_real
from defenses.s3t import inputs
from defenses.s3t.adapters import AdaptedModel, Targets, running_stats
from defenses.threads import single_thread

Norm = Literal["layer", "batch"]
M = TypeVar("M", bound=nn.Module)
MAX_SIZE = 2**16
"""Largest width, depth or class count of a ResidualMLP (beyond: out of memory)."""


class Block(nn.Module):
    """One pre-norm residual MLP block."""

    def __init__(self, width: int, hidden: int, norm: Norm) -> None:
        super().__init__()
        self.norm: nn.Module = (
            nn.LayerNorm(width) if norm == "layer" else nn.BatchNorm1d(width)
        )
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, h: Tensor) -> Tensor:
        """``h + fc2(GELU(fc1(norm(h))))``."""
        v: Tensor = self.fc2(F.gelu(self.fc1(self.norm(h))))
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
            check_int(f"ResidualMLP.{name}", value, 1, MAX_SIZE)
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

    def forward(self, x: Tensor) -> Tensor:
        """Logits: stem, blocks, final norm, head."""
        h: Tensor = self.stem(x)
        for block in self.blocks:
            h = block(h)
        logits: Tensor = self.head(self.norm(h))
        return logits

    def default_targets(self) -> list[str]:
        """The layers S3T adapts by default: both linear maps of every block."""
        return [
            f"blocks.{i}.{fc}" for i in range(self.n_blocks) for fc in ("fc1", "fc2")
        ]

    def has_shared_state(self) -> bool:
        """Whether training in train mode would update buffers (BatchNorm stats)."""
        return running_stats(self)


def frozen_copy(backbone: M) -> M:
    """A deep copy with every parameter frozen (``requires_grad=False``)."""
    clone = copy.deepcopy(backbone)
    clone.requires_grad_(False)
    return clone


def adapt(
    model: nn.Module, target_modules: Targets | None, head: str | None, keep: bool
) -> AdaptedModel:
    """The user's model with its adapter targets (the ResidualMLP's by default)."""
    if target_modules is None:
        if not isinstance(model, ResidualMLP):
            raise ValueError(
                f"target_modules is required for a {type(model).__name__}: the names "
                "(or a predicate) of the layers that get the sliced adapters, as in "
                "peft's LoraConfig(target_modules=...)"
            )
        target_modules, head = model.default_targets(), head or "head"
    return AdaptedModel(model, target_modules, head, keep_mode=keep)


def train_module(
    model: nn.Module,
    X: npt.NDArray[np.generic],
    y: npt.NDArray[np.int64],
    gen: torch.Generator,
    epochs: int,
    lr: float,
    batch_size: int,
) -> None:
    """Train every parameter of ``model`` in place (Adam, cross-entropy, train mode).

    Mini-batches are drawn by ``gen``; one torch thread.
    """
    features, labels = torch.as_tensor(X), torch.as_tensor(y)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    with single_thread():
        model.train()
        for _ in range(epochs):
            order = torch.randperm(len(labels), generator=gen)
            for start in range(0, len(labels), batch_size):
                batch = order[start : start + batch_size]
                optimizer.zero_grad()
                loss = F.cross_entropy(model(features[batch]), labels[batch])
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()


def pretrain(
    X: npt.ArrayLike,
    y: npt.ArrayLike,
    rng: np.random.Generator,
    *,
    n_classes: int | None = None,
    width: int = 96,
    hidden: int = 192,
    n_blocks: int = 6,
    epochs: int = 30,
    lr: float = 3e-3,
    batch_size: int = 64,
    norm: Norm = "layer",
) -> ResidualMLP:
    """Train a backbone on public data, then freeze it and put it in eval mode.

    Adam on the cross-entropy, ``epochs`` passes in mini-batches. ``y`` holds class
    indices ``0 .. K-1``; the head has ``n_classes`` outputs (``max(y) + 1`` if None,
    at least 2), so pass the fine-tuning task's class count when the public data
    cover only some classes. The public split is treated as non-deletable:
    exactness of unlearning covers the fine-tuning data only.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"rng must be a numpy.random.Generator, got {type(rng).__name__}"
        )
    features_np = inputs.model_inputs(X, None, None)
    if features_np.ndim != 2:
        raise ValueError(f"X must have shape (n, d), got {features_np.shape}")
    labels_np = inputs.class_codes(y, features_np.shape[0])
    needed = int(labels_np.max()) + 1
    k = (
        max(needed, 2)
        if n_classes is None
        else check_int("n_classes", n_classes, 2, MAX_SIZE)
    )
    if k < needed:
        raise ValueError(f"n_classes={k} is too small for labels up to {needed - 1}")
    check_int("epochs", epochs, minimum=1)
    check_int("batch_size", batch_size, minimum=1)
    check_real("lr", lr, 0.0, 1.0, open_low=True, open_high=True)
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    model = ResidualMLP(features_np.shape[1], width, hidden, n_blocks, k, norm, gen)
    train_module(model, features_np, labels_np, gen, epochs, lr, batch_size)
    model.eval()
    return frozen_copy(model)
