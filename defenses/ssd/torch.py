"""SSD for torch: a module, or any callable, whose answers pass through the shield."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from scipy.special import softmax


class Shield(Protocol):
    """What the wrappers need of a fitted shield (a ``StealthyShield``)."""

    def __call__(self, probs: Any, inputs: Any = None) -> Any:
        """Defended probabilities."""
        ...


class ShieldedModule(torch.nn.Module):
    """A torch module whose forward pass answers SSD-defended probabilities.

    The output is detached from the autograd graph: it is an API answer.
    """

    def __init__(
        self, model: torch.nn.Module, shield: Shield, logits: bool = True
    ) -> None:
        super().__init__()
        self.model = model
        self.shield = shield
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Defended probabilities of shape (N, K)."""
        with torch.no_grad():
            out = self.model(x)
            probs = torch.softmax(out.double(), dim=-1) if self.logits else out
        answers: torch.Tensor = self.shield(probs, inputs=x)
        return answers.to(out.dtype)


class ShieldedCallable:
    """Any callable returning probabilities (or logits), defended by SSD."""

    def __init__(
        self, model: Callable[[Any], Any], shield: Shield, logits: bool = False
    ) -> None:
        self.model = model
        self.shield = shield
        self.logits = logits

    def __call__(self, x: Any) -> Any:
        """Defended probabilities for the batch ``x``."""
        out = self.model(x)
        if isinstance(out, torch.Tensor):
            probs_t = (
                torch.softmax(out.double(), dim=-1).to(out.dtype)
                if self.logits
                else out
            )
            return self.shield(probs_t, inputs=x)
        arr = np.asarray(out, dtype=np.float64)
        probs = softmax(arr, axis=1) if self.logits else arr
        return self.shield(probs, inputs=x)
