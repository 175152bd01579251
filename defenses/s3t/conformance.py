r"""The conformance pass S3T runs on the user's module at ``fit``.

S3T's exactness (a retrained model equals, bit for bit, a fresh fit on the
surviving data; a deactivated stage leaves exactly its parent) rests on two
properties of the frozen backbone that nothing else enforces:

1. **Determinism.** The forward pass is a function of its input, the bound adapters
   and the head: two passes on the same batch give identical outputs, and the
   forward draws no random numbers. ``F.dropout(h, 0.2)`` breaks it in eval mode too
   (its ``training`` defaults to True), as does noise drawn inside ``forward``.
2. **A frozen backbone.** No parameter, buffer or plain state attribute (a tensor,
   a number, a container of tensors: a counter, a cache or a log of inputs) of the
   backbone changes during the probe's forward passes and a training step
   (forward, backward and optimizer step on a stage's adapters and head). A
   forward that updates buffers itself (``F.batch_norm(..., training=True)`` with
   running statistics, a counter) makes every stage write
   into state shared by all stages: a leak across deletions that S3T's records do
   not see.

:func:`check_conformance` runs both checks on a small batch and raises
``ValueError`` naming the cause: the random function the forward called, or the
tensor that moved and the function that moved it. A torch function mode records
which random and statistics-updating functions the forward calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from defenses.s3t.adapters import AdaptedModel

_DROPOUTS: Mapping[str, tuple[int, bool]] = {
    "dropout": (2, True),
    "dropout1d": (2, True),
    "dropout2d": (2, True),
    "dropout3d": (2, True),
    "alpha_dropout": (2, False),
    "feature_alpha_dropout": (2, False),
}
"""Dropout functions: position of ``training`` and its default."""

_RANDOM = frozenset(
    {
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "bernoulli",
        "bernoulli_",
        "normal",
        "normal_",
        "uniform_",
        "random_",
        "exponential_",
        "multinomial",
        "poisson",
        "rrelu",
        "native_dropout",
    }
)
"""Functions and tensor methods that draw random numbers."""


class _Watch(TorchFunctionMode):
    """Records the random and statistics-updating calls of a forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.random: list[str] = []
        self.updates: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _DROPOUTS:
            index, default = _DROPOUTS[name]
            training = args[index] if len(args) > index else kwargs.get("training")
            if default if training is None else bool(training):
                self.random.append(f"torch.nn.functional.{name}(..., training=True)")
        elif name in _RANDOM:
            self.random.append(name)
        elif func is F.batch_norm or func is F.instance_norm:
            training = args[5] if len(args) > 5 else kwargs.get("training", False)
            stats = args[1] if len(args) > 1 else kwargs.get("running_mean")
            if training and stats is not None:
                self.updates.append(f"torch.nn.functional.{name}(..., training=True)")
        return func(*args, **kwargs)


def _state(model: AdaptedModel) -> dict[str, tuple[str, Tensor]]:
    """Every parameter and buffer of the backbone (kind, a copy), by name."""
    out = {
        name: ("parameter", t.detach().clone())
        for name, t in model.module.named_parameters()
    }
    out.update(
        (name, ("buffer", t.detach().clone()))
        for name, t in model.module.named_buffers()
    )
    return out


def _attributes(model: AdaptedModel) -> dict[str, Any]:
    """Plain attributes of every submodule that can hold state a forward writes.

    Tensors that are not registered buffers, numbers (not bools) and containers
    holding a tensor (a cache or log of inputs), by ``module.attribute`` name.
    """
    out: dict[str, Any] = {}
    for prefix, module in model.module.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_") or key == "training":
                continue
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, Tensor):
                out[name] = value.detach().clone()
            elif isinstance(value, int | float) and not isinstance(value, bool):
                out[name] = value
            elif isinstance(value, list | tuple | dict | set) and _holds_tensor(value):
                out[name] = repr(value)
    return out


def _holds_tensor(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(isinstance(v, Tensor) for v in items)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.shape == b.shape
            and torch.equal(a, b.detach())
        )
    return bool(a == b)


def _first_difference(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    gap = (a.double() - b.double()).abs()
    gap = torch.where(torch.isnan(gap), torch.inf, gap)
    return float(gap.max()) if gap.numel() else 0.0


def check_conformance(
    model: AdaptedModel,
    x: Tensor,
    y: Tensor,
    rank: int,
    lr: float,
    shared_state: bool = False,
) -> None:
    """Refuse a backbone that is random or that moves during a training step.

    Parameters
    ----------
    model : AdaptedModel
        The frozen copy of the user's module.
    x, y : Tensor
        A small training batch (inputs as the model takes them, class codes).
    rank : int
        Adapter rank of the probe adapters.
    lr : float
        Learning rate of the probe step (Adam, as a stage trains).
    shared_state : bool
        The negative-control mode (``allow_shared_state=True``): buffers may move.

    Raises
    ------
    ValueError
        The message starts with ``model:`` and names the cause.
    """
    gen = torch.Generator().manual_seed(0)
    probe = model.fresh(model.targets, rank, gen)
    attributes = _attributes(model)
    with torch.no_grad(), model.bound(probe), _Watch() as watch:
        first = model.run(x)
        second = model.run(x)
    gap = _first_difference(first, second)
    if watch.random or gap > 0:
        cause = (
            f"its forward calls {sorted(set(watch.random))}"
            if watch.random
            else "its forward is not a function of its input"
        )
        raise ValueError(
            f"model: two forward passes on the same batch differ (by up to "
            f"{gap:.3g}) or draw random numbers: {cause}. S3T's exact deletion "
            "needs a deterministic forward: pass training=self.training to "
            "functional dropout (F.dropout defaults to training=True) or use "
            "nn.Dropout, and draw no noise in forward"
        )
    before = _state(model)
    adapters = {
        t: (a.clone().requires_grad_(True), b.clone().requires_grad_(True))
        for t, (a, b) in probe.items()
    }
    head = {
        n: t.detach().clone().requires_grad_(True) for n, t in model.base_head.items()
    }
    trained = [t for lora in adapters.values() for t in lora] + list(head.values())
    optimizer = torch.optim.Adam(trained, lr=lr)
    with model.bound(adapters, head), _Watch() as watch:
        loss = F.cross_entropy(model.run(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    now = _attributes(model)
    written = [
        n
        for n in sorted(set(attributes) | set(now))
        if n not in attributes or n not in now or not _same(attributes[n], now[n])
    ]
    if written:
        raise ValueError(
            f"model: attribute {written[0]!r} of the backbone changed during "
            f"forward passes and a training step ({len(written)} attribute(s): "
            f"{written[:4]}): the forward keeps state (a counter, a cache or log of "
            "its inputs) outside S3T's records, which deletion cannot erase and "
            "which makes every stage depend on the ones before; keep forward "
            "free of side effects"
        )
    after = _state(model)
    moved = [n for n, (_, t) in before.items() if not torch.equal(t, after[n][1])]
    if moved and not shared_state:
        kind = before[moved[0]][0]
        cause = (
            f"its forward calls {sorted(set(watch.updates))}"
            if watch.updates
            else "something in forward or backward writes to it"
        )
        raise ValueError(
            f"model: {kind} {moved[0]!r} of the frozen backbone changed during a "
            f"training step ({len(moved)} tensor(s) moved: {moved[:4]}); {cause}. "
            "Every stage would write into state all stages share, a leak across "
            "deletions: update no buffer in forward (use nn.BatchNorm in eval mode "
            "or F.batch_norm(..., training=False))"
        )
