"""User modules written to break S3T's assumptions (issue 27), one per way.

Small MLPs on 8 float features (or 8 tokens) with 3 classes. Some break
determinism or the frozen backbone (functional dropout, noise in forward, buffers
updated in forward), some are broken (NaN weights or logits), some are legitimate
variants that must work (a positional embedding over float features, a train()
model whose BatchNorm is in eval mode) or get an error naming their dtype (float64).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FEATURES, CLASSES = 8, 3
SETTINGS = {"target_modules": ["fc1", "fc2"], "head": "out"}


def _redraw(module: nn.Module, seed: int) -> None:
    """Every parameter from a seeded generator (never torch's global RNG)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


class UserMLP(nn.Module):
    """Two hidden layers and a head; subclasses change ``forward``.

    A subclass that keeps state declares where: ``state`` (plain attributes) and
    ``initial_buffers`` (registered buffers), each instance starting from a copy.
    """

    state: ClassVar[dict[str, Any]] = {}
    initial_buffers: ClassVar[dict[str, torch.Tensor]] = {}

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 16)
        self.fc2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, CLASSES)
        _redraw(self, seed)
        self.eval()
        for name, value in self.state.items():
            setattr(self, name, copy.deepcopy(value))
        for name, tensor in self.initial_buffers.items():
            self.register_buffer(name, tensor.clone())

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(x))


class FunctionalDropout(UserMLP):
    """``F.dropout(h, 0.2)``: ``training=True`` by default, random in eval too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.dropout(self.hidden(x), 0.2))


class NoisyForward(UserMLP):
    """Noise drawn in forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        return self.out(h + 0.1 * torch.randn_like(h))


class BatchNormInForward(UserMLP):
    """``F.batch_norm(..., training=True)``: its running statistics move."""

    initial_buffers: ClassVar[dict[str, torch.Tensor]] = {
        "mean": torch.zeros(16),
        "var": torch.ones(16),
    }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.batch_norm(self.hidden(x), self.mean, self.var, training=True)
        return self.out(h)


class CountingForward(UserMLP):
    """A buffer the forward increments (not read: outputs stay deterministic)."""

    initial_buffers: ClassVar[dict[str, torch.Tensor]] = {"calls": torch.zeros(())}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.out(self.hidden(x))


class LoggingForward(UserMLP):
    """Keeps every input it sees (a cache of training rows deletion cannot reach)."""

    state: ClassVar[dict[str, Any]] = {"seen": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.detach())
        return self.out(self.hidden(x))


class PythonCounter(UserMLP):
    """A Python counter the forward reads: outputs change after a number of calls."""

    state: ClassVar[dict[str, Any]] = {"calls": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.out(self.hidden(x)) * (1.0 if self.calls < 50 else 2.0)


class NaNLogits(UserMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(x)) * float("nan")


class PositionalEmbedding(UserMLP):
    """Float features, each plus a learned embedding of its position."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.pos = nn.Embedding(FEATURES, 1)
        _redraw(self.pos, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        where = torch.arange(x.shape[1])
        return self.out(self.hidden(x + self.pos(where)[:, 0]))


class TokenModel(nn.Module):
    """Token ids through an embedding, mean-pooled."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.tok = nn.Embedding(20, 16)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, CLASSES)
        _redraw(self, seed)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x).mean(1)
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(h)))))


class BatchNormEval(UserMLP):
    """A BatchNorm layer in eval mode inside a model in train mode."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.bn = nn.BatchNorm1d(16)
        self.train()
        self.bn.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.hidden(x)))


def nan_weights(seed: int = 0) -> UserMLP:
    model = UserMLP(seed)
    with torch.no_grad():
        model.fc2.bias[3] = float("nan")
    return model


def float64(seed: int = 0) -> nn.Module:
    return UserMLP(seed).double()


def compiled(seed: int = 0) -> nn.Module:
    return torch.compile(UserMLP(seed))  # type: ignore[return-value]


def scripted(seed: int = 0) -> nn.Module:
    return torch.jit.script(UserMLP(seed))  # type: ignore[no-any-return]


def traced(seed: int = 0) -> nn.Module:
    example = torch.zeros(2, FEATURES)
    return torch.jit.trace(UserMLP(seed), example)  # type: ignore[no-any-return]


def data(n: int = 48, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = np.arange(n) % CLASSES
    return X, y, np.arange(100, 100 + n)


REFUSED = {
    "functional-dropout": (FunctionalDropout, "functional.dropout(..., training=True)"),
    "noisy-forward": (NoisyForward, "randn_like"),
    "batch-norm-in-forward": (BatchNormInForward, "buffer 'mean'"),
    "counting-forward": (CountingForward, "buffer 'calls'"),
    "logging-forward": (LoggingForward, "attribute 'seen'"),
    "python-counter": (PythonCounter, "attribute 'calls'"),
    "nan-logits": (NaNLogits, "nan or inf"),
    "nan-weights": (nan_weights, "parameter 'fc2.bias'"),
    "float64": (float64, "torch.float64"),
    "scripted": (scripted, "TorchScript module"),
    "traced": (traced, "TorchScript module"),
}
"""Modules S3T must refuse at fit, and a phrase the refusal must contain."""

ACCEPTED = {
    "plain": UserMLP,
    "positional-embedding": PositionalEmbedding,
    "batch-norm-eval-in-train-model": BatchNormEval,
    "compiled": compiled,
}
"""Modules on float features that S3T must fit and serve exactly."""
