"""User S3T models that keep state a step can move (issue 39, items 4 and 8).

Each keeps its state in another place: a list, a dict, a Python float, a buffer,
a parameter written by the forward itself (Glow-style ActNorm, ``nn.Embedding``
with ``max_norm``), a global, a class attribute, a hook's closure, a default
argument, or state written only for some inputs. Each must be refused at ``fit`` by
cause, naming the state; the variants that keep nothing (initialised once before,
renormalised once before, constants, stateless hooks) must fit and stay exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from tests.defenses.s3t.user_modules import CLASSES, TokenModel, UserMLP

_CALLS = [0]
"""A module-level counter the ``GlobalCounter`` forward increments."""


class ListCounter(UserMLP):
    """A call counter in a list: outputs double after 10 calls (issue 39)."""

    state: ClassVar[dict[str, Any]] = {"calls": [0]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        return self.out(self.hidden(x)) * (1.0 if self.calls[0] < 10 else 2.0)


class FloatLog(UserMLP):
    """A list of floats: the mean of the inputs seen so far shifts the input."""

    state: ClassVar[dict[str, Any]] = {"history": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.history.append(float(x.mean()))
        shift = sum(self.history) / len(self.history)
        return self.out(self.hidden(x - shift))


class ActNorm(nn.Module):
    """Glow's activation normalisation: data-dependent init on the first forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(width))
        self.log_scale = nn.Parameter(torch.zeros(width))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not bool(self.initialized):
            with torch.no_grad():
                self.loc.copy_(-h.mean(0))
                self.log_scale.copy_(-torch.log(h.std(0) + 1e-6))
                self.initialized.fill_(1)
        return (h + self.loc) * torch.exp(self.log_scale)


class ActNormMLP(UserMLP):
    """``UserMLP`` with an ActNorm layer after the hidden layers."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.act = ActNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.hidden(x)))


def actnorm_initialised(seed: int = 0) -> ActNormMLP:
    """ActNorm initialised by the user on public data before S3T sees it."""
    model = ActNormMLP(seed)
    public = torch.randn(64, 8, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        model(public)
    return model


class MaxNormTokens(TokenModel):
    """``nn.Embedding(max_norm=1.0)``: renormalises looked-up rows in place."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.tok.max_norm = 1.0


def renormalised_tokens(seed: int = 0) -> TokenModel:
    """Every row renormalised once to norm <= 1, then ``max_norm=None``."""
    model = TokenModel(seed)
    with torch.no_grad():
        w = model.tok.weight
        w.mul_(1.0 / w.norm(dim=1, keepdim=True).clamp(min=1.0))
    return model


class DictCache(UserMLP):
    """A dict cache: the first hidden state per batch size is reused as a bias."""

    state: ClassVar[dict[str, Any]] = {"cache": {}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        bias = self.cache.setdefault(x.shape[0], float(h.detach().mean()))
        return self.out(h - bias)


class FloatEMA(UserMLP):
    """A Python float attribute updated in forward (a running scale)."""

    state: ClassVar[dict[str, Any]] = {"scale": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        self.scale = 0.9 * self.scale + 0.1 * float(h.detach().std())
        return self.out(h / self.scale)


class RunningMean(UserMLP):
    """A buffer updated in forward, as BatchNorm's running statistics in train mode."""

    initial_buffers: ClassVar[dict[str, torch.Tensor]] = {"running": torch.zeros(16)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * h.mean(0))
        return self.out(h - self.running)


class GlobalCounter(UserMLP):
    """A module-level global the forward increments (outside the module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CALLS[0] += 1
        return self.out(self.hidden(x)) * (1.0 if _CALLS[0] < 50 else 2.0)


class ClassCounter(UserMLP):
    """A class attribute the forward increments (shared by every instance)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return self.out(self.hidden(x))


class DefaultArgument(UserMLP):
    """A mutable default argument that logs the batch sizes it sees."""

    def forward(self, x: torch.Tensor, seen: list[int] = []) -> torch.Tensor:  # noqa: B006
        seen.append(x.shape[0])
        return self.out(self.hidden(x))


class RareInputs(UserMLP):
    """State written only for some inputs (none of the first eight rows)."""

    state: ClassVar[dict[str, Any]] = {"outliers": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] > 2.2).any()):
            self.outliers += 1
        return self.out(self.hidden(x))


def hook_closure(seed: int = 0) -> UserMLP:
    """A forward hook on ``fc2`` whose closure counts the calls."""
    model = UserMLP(seed)
    count = [0]

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return out

    model.fc2.register_forward_hook(hook)
    return model


def stateless_hook(seed: int = 0) -> UserMLP:
    """A forward hook that scales ``fc2``'s output and keeps nothing."""
    model = UserMLP(seed)

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return 0.5 * out

    model.fc2.register_forward_hook(hook)
    return model


class Constants(UserMLP):
    """Plain attributes that the forward reads and never writes."""

    state: ClassVar[dict[str, Any]] = {
        "temperature": 2.0,
        "config": {"names": ["a", "b"], "scale": [1.0, 0.5]},
    }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(x)) / self.temperature * self.config["scale"][0]


class ShapeCache(UserMLP):
    """A mask built on first use and kept on ``self`` (depends on shapes only)."""

    state: ClassVar[dict[str, Any]] = {"_mask": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._mask is None:
            self._mask = torch.ones(16)
        return self.out(self.hidden(x) * self._mask)


Factory = Callable[[], nn.Module]

REFUSED: dict[str, tuple[Factory, str]] = {
    "list-counter": (ListCounter, "attribute 'calls[0]'"),
    "float-list": (FloatLog, "attribute 'history'"),
    "actnorm": (ActNormMLP, "parameter 'act.loc'"),
    "embedding-max-norm": (MaxNormTokens, "parameter 'tok.weight'"),
    "dict-cache": (DictCache, "attribute 'cache'"),
    "float-ema": (FloatEMA, "attribute 'scale'"),
    "buffer-in-forward": (RunningMean, "buffer 'running'"),
    "global-counter": (GlobalCounter, "global 'tests.defenses.s3t.soundness"),
    "class-counter": (ClassCounter, "class attribute"),
    "default-argument": (DefaultArgument, "default argument"),
    "rare-inputs": (RareInputs, "attribute 'outliers'"),
    "hook-closure": (hook_closure, "closure variable"),
    "shape-cache": (ShapeCache, "attribute '_mask'"),
}
"""User models S3T must refuse at fit, and a phrase the refusal must contain."""

ACCEPTED: dict[str, Factory] = {
    "actnorm-initialised": actnorm_initialised,
    "embedding-renormalised": renormalised_tokens,
    "constants": Constants,
    "stateless-hook": stateless_hook,
}
"""Variants that keep no moving state: S3T must fit them and stay exact."""

TOKENS = frozenset({"embedding-max-norm", "embedding-renormalised"})
"""Models that take token ids (``TokenModel``'s vocabulary of 20) instead of floats."""

__all__ = ["ACCEPTED", "CLASSES", "REFUSED", "TOKENS"]
