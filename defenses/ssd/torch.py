"""SSD for torch: a module, or any callable, whose answers pass through the shield.

:class:`ShieldedModule` keeps the defense in its ``state_dict``: the shield's
prototypes, settings and random stream are three buffers (``shield_prototypes``,
``shield_settings``, ``shield_stream``), so ``torch.save(module.state_dict())``,
``torch.load(..., weights_only=True)`` and ``load_state_dict`` into a module built
around an unfitted shield restore a defense that answers exactly as the saved one
would have.

What the wrapped model returns is read from its last layer (``nn.Softmax``:
probabilities, ``nn.LogSoftmax``: log-probabilities, else logits) or given as
``outputs=``; outputs that are already probabilities (non-negative rows summing to
one) are never softmaxed again: ``"auto"`` takes them as probabilities and
``"logits"`` refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from defenses.checks import check_choice
from defenses.ssd.state import STATE_KEYS, load_shield_state, shield_state

OUTPUTS = ("auto", "probs", "logits", "log-probs")
BUFFERS = {key: f"shield_{key}" for key in STATE_KEYS}


class Shield(Protocol):
    """What the wrappers need of a shield (a ``StealthyShield``)."""

    @property
    def is_fitted(self) -> bool:
        """Whether the prototypes exist."""
        ...

    def __call__(self, probs: Any, inputs: Any = None) -> Any:
        """Defended probabilities."""
        ...


def check_outputs(outputs: str) -> str:
    """Return ``outputs`` if it is one of :data:`OUTPUTS`, else raise ValueError."""
    return check_choice("outputs", outputs, OUTPUTS)


def module_outputs(module: torch.nn.Module) -> str:
    """What a module returns, read from its last layer (nested ``Sequential`` too)."""
    last = module
    while isinstance(last, torch.nn.Sequential) and len(last):
        last = last[-1]
    if isinstance(last, torch.nn.Softmax):
        return "probs"
    if isinstance(last, torch.nn.LogSoftmax):
        return "log-probs"
    return "logits"


def _probability_rows(values: torch.Tensor) -> bool:
    """Whether every row is non-negative and sums to one (within float32 rounding)."""
    if values.ndim != 2 or values.shape[0] == 0 or values.is_complex():
        return False
    tolerance = 1e-6 + 8 * float(torch.finfo(torch.float32).eps) * values.shape[1]
    rows = values.detach().double()
    return bool((rows >= 0).all()) and bool(
        ((rows.sum(1) - 1).abs() <= tolerance).all()
    )


def to_probs(out: torch.Tensor, outputs: str) -> torch.Tensor:
    """The model's outputs as float64 probabilities, softmaxing logits only."""
    if outputs == "log-probs":
        return out.detach().double().exp()
    if outputs == "probs" or (outputs == "auto" and _probability_rows(out)):
        return out.detach().double()
    if outputs == "logits" and _probability_rows(out):
        raise ValueError(
            "outputs='logits', but the model's rows are already probabilities "
            "(non-negative, summing to one): pass outputs='probs' (a softmax of "
            "probabilities would flatten them)"
        )
    return torch.softmax(out.detach().double(), dim=-1)


class ShieldedModule(torch.nn.Module):
    """A torch module whose forward pass answers SSD-defended probabilities.

    Parameters
    ----------
    model : torch.nn.Module
        The deployed model (left unchanged).
    shield : StealthyShield
        Fitted, or unfitted to be filled by :meth:`load_state_dict`.
    outputs : {"auto", "probs", "logits", "log-probs"}
        What ``model`` returns; ``"auto"`` reads its last layer.

    The answer is detached from the autograd graph: it is an API answer.
    """

    def __init__(
        self, model: torch.nn.Module, shield: Shield, outputs: str = "auto"
    ) -> None:
        super().__init__()
        check_outputs(outputs)
        self.model = model
        self.shield = shield
        self.outputs = module_outputs(model) if outputs == "auto" else outputs
        self.auto = outputs == "auto"
        for name in BUFFERS.values():
            self.register_buffer(name, torch.empty(0))
        if shield.is_fitted:
            self._sync()

    def _sync(self) -> None:
        """Write the shield's state into the buffers."""
        for key, array in shield_state(self.shield).items():
            device = getattr(self, BUFFERS[key]).device
            setattr(self, BUFFERS[key], torch.from_numpy(array).to(device))

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's and the shield's state (synced from the shield first)."""
        if self.shield.is_fitted:
            self._sync()
        return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(
        self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        for name in BUFFERS.values():
            if prefix + name in state_dict:
                incoming = state_dict[prefix + name]
                setattr(self, name, torch.empty_like(incoming, device="cpu"))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        arrays = {
            key: getattr(self, name).cpu().numpy() for key, name in BUFFERS.items()
        }
        if arrays["prototypes"].size:
            load_shield_state(self.shield, arrays)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Defended probabilities of shape (N, K), in the model's output dtype."""
        with torch.no_grad():
            out = self.model(x)
            detect = self.auto and self.outputs == "logits"
            probs = to_probs(out, "auto" if detect else self.outputs)
        answers: torch.Tensor = self.shield(probs, inputs=x)
        return answers.to(out.dtype)


class ShieldedCallable:
    """Any callable returning probabilities, logits or log-probabilities, defended.

    ``outputs="auto"`` (what a callable returns cannot be read from it) takes rows
    that are already probabilities as they are and softmaxes anything else (logits,
    or log-probabilities, whose softmax is the probabilities themselves).
    """

    def __init__(
        self, model: Callable[[Any], Any], shield: Shield, outputs: str = "auto"
    ) -> None:
        self.model = model
        self.shield = shield
        self.outputs = check_outputs(outputs)

    def __call__(self, x: Any) -> Any:
        """Defended probabilities for the batch ``x``."""
        out = self.model(x)
        if isinstance(out, torch.Tensor):
            return self.shield(to_probs(out, self.outputs).to(out.dtype), inputs=x)
        array = np.asarray(out)
        if array.dtype.kind not in "fiub":
            raise TypeError(f"the model must return real numbers, got {array.dtype}")
        probs = to_probs(torch.from_numpy(array.astype(np.float64)), self.outputs)
        return self.shield(probs.numpy(), inputs=x)
