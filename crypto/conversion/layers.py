"""The layers of :class:`~crypto.conversion.model.HEBert`: BERT's, with LoRA on Q, K, V.

Weights keep ``torch.nn.Linear``'s (out, in) layout, so a source layer's tensors
copy over unchanged; everything is float64, as the CKKS path is.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRALinear(nn.Module):
    r""":math:`x \mapsto x (W_0^T + A B) + b` with a rank-r adapter, ``B`` = 0 first.

    ``weight`` and ``bias`` keep ``torch.nn.Linear``'s layout (out, in), so the
    source layer's tensors copy over unchanged.
    """

    def __init__(self, d_in: int, d_out: int, rank: int, generator: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d_out, d_in, dtype=torch.float64))
        self.bias = nn.Parameter(torch.zeros(d_out, dtype=torch.float64))
        self.lora_a = nn.Parameter(
            torch.randn(d_in, rank, generator=generator, dtype=torch.float64)
            / math.sqrt(d_in)
        )
        self.lora_b = nn.Parameter(torch.zeros(rank, d_out, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the adapted linear map."""
        return x @ self.weight.T + self.bias + (x @ self.lora_a) @ self.lora_b


def linear(d_in: int, d_out: int) -> nn.Linear:
    """A float64 ``nn.Linear`` (its weights are copied from the source)."""
    return nn.Linear(d_in, d_out, dtype=torch.float64)


def layer_norm(d: int) -> nn.LayerNorm:
    """A float64 ``nn.LayerNorm`` (its gain and bias are copied from the source)."""
    return nn.LayerNorm(d, dtype=torch.float64)


class HEBertLayer(nn.Module):
    """One converted BERT block (names follow ``transformers``' BertLayer)."""

    def __init__(self, d: int, ffn: int, rank: int, generator: torch.Generator):
        super().__init__()
        self.query = LoRALinear(d, d, rank, generator)
        self.key = LoRALinear(d, d, rank, generator)
        self.value = LoRALinear(d, d, rank, generator)
        self.attention_dense = linear(d, d)
        self.attention_norm = layer_norm(d)
        self.intermediate = linear(d, ffn)
        self.output_dense = linear(ffn, d)
        self.output_norm = layer_norm(d)
