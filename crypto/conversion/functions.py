r"""The exact functions a source BERT evaluates, as read from its installed modules.

:func:`~crypto.conversion.convert` reads the activation of every block from the
module installed there (not from ``config.hidden_act``), and the self-check
(:mod:`~crypto.conversion.selfcheck`) runs the converted structure with these
functions before any polynomial stands in for them:

* attention: :math:`\mathrm{softmax}(q k^T / \sqrt{d_h} + M)\,v` with
  :math:`M_{ij} = -\infty` where key :math:`j` is padding;
* activations: the erf GELU :math:`x\,\Phi(x)`, the tanh GELU
  :math:`\tfrac12 x (1 + \tanh(\sqrt{2/\pi}(x + 0.044715 x^3)))`, the quick GELU
  :math:`x\,\sigma(1.702 x)` and ReLU, each mapped from the library's own classes
  (``transformers.activations`` and ``torch.nn``) by class identity.

Each function is written here with ``torch`` primitives (``erf``, ``tanh``,
``sigmoid``, ``exp``), so a patched ``torch.nn.functional.gelu`` or a module whose
function attribute was swapped shows up as a difference in the self-check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Function = Callable[[torch.Tensor], torch.Tensor]


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    r""":math:`x\,\Phi(x) = \tfrac12 x (1 + \mathrm{erf}(x/\sqrt2))`."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    r""":math:`\tfrac12 x (1 + \tanh(\sqrt{2/\pi}(x + 0.044715 x^3)))`."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    )


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    r""":math:`x\,\sigma(1.702 x)`."""
    return x * torch.sigmoid(1.702 * x)


def relu(x: torch.Tensor) -> torch.Tensor:
    r""":math:`\max(x, 0)`."""
    return torch.clamp(x, min=0.0)


@dataclass(frozen=True)
class Activation:
    """One block's feed-forward activation.

    Parameters
    ----------
    name : str
        The installed module's class and what it computes.
    family : {"gelu", "relu"}
        The function family the converted model's polynomial may fit.
    function : callable
        The exact function, in ``torch`` primitives.
    """

    name: str
    family: str
    function: Function


def read_activation(module: object) -> Activation | None:
    """The exact activation an installed module computes, or None if unknown.

    Known by class identity: ``transformers.activations``' GELU classes, and
    ``torch.nn.GELU`` / ``torch.nn.ReLU``; anything else (``nn.Tanh``, ``nn.SiLU``,
    a plain function) is None.
    """
    from transformers import activations as act

    kind = type(module)
    if kind is nn.ReLU:
        return Activation("torch.nn.ReLU", "relu", relu)
    if kind is nn.GELU:
        tanh = getattr(module, "approximate", "none") == "tanh"
        return Activation(
            f"torch.nn.GELU(approximate={'tanh' if tanh else 'none'!r})",
            "gelu",
            tanh_gelu if tanh else erf_gelu,
        )
    table: dict[str, tuple[str, Function]] = {
        "GELUActivation": ("erf GELU", erf_gelu),
        "NewGELUActivation": ("tanh GELU", tanh_gelu),
        "GELUTanh": ("tanh GELU", tanh_gelu),
        "PytorchGELUTanh": ("tanh GELU", tanh_gelu),
        "FastGELUActivation": ("tanh GELU", tanh_gelu),
        "AccurateGELUActivation": ("tanh GELU", tanh_gelu),
        "QuickGELUActivation": ("quick GELU x sigmoid(1.702 x)", quick_gelu),
    }
    for name, (what, function) in table.items():
        if kind is getattr(act, name, None):
            return Activation(f"{name} ({what})", "gelu", function)
    return None


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    r"""Attention probabilities :math:`\mathrm{softmax}(q k^T s + M)`, (b, h, n, n).

    ``mask`` is the (batch, n) 0/1 attention mask; a padded key gets
    :math:`-\infty` (the first key is always attended, so no row is empty).
    """
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    return torch.softmax(scores, dim=-1)


@dataclass(frozen=True)
class SourceFunctions:
    """What the source computes at every site the conversion will approximate.

    Parameters
    ----------
    activations : tuple of Activation
        One per encoder block, first to last.
    """

    activations: tuple[Activation, ...]

    def describe_activations(self) -> str:
        """The installed activations, once if every block has the same."""
        names = [a.name for a in self.activations]
        if len(set(names)) == 1:
            return names[0]
        return ", ".join(f"layer {i}: {n}" for i, n in enumerate(names))
