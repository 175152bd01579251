r"""The HE-friendly transformer, scaled down.

Rho et al., "Encryption-Friendly LLM Architecture", ICLR 2025: ``n_layers`` blocks
(the paper uses 2), LoRA on Q, K, V, a tanh pooler head. Forward pass for a sequence
:math:`x \\in \\mathbb R^{n \\times t}` (all layers bias-free, as in the paper); block
:math:`l` maps :math:`z` to :math:`o`, the next block's :math:`z`, with its own
weights and calibrated ranges:

.. math::

    z &= x W_e + P                                   &\\text{(client side)}\\\\
    S^h_{ij} &= \\exp\\!\\big(-\\lVert q^h_i - k^h_j\\rVert^2 / (2\\sqrt{d_h})\\big),
      \\quad q = z(W_q + A_q B_q), \\ldots  &\\text{(no normalisation)}\\\\
    h &= z + [S^1 v^1, \\ldots, S^H v^H] W_o \\\\
    u &= \\gamma \\odot (h - \\bar h)\\, \\mathrm{isqrt}(\\sigma^2_h)\\\\
    o &= h + \\phi(u W_1) W_2, \\quad \\phi(a) = \\alpha a + \\beta a^2 \\\\
    \\text{logits} &= \\tau(o_0 W_p / B_p)\\, W_c,
      \\quad \\tau \\approx \\tanh(2\\,\\cdot)

In *polynomial* mode every non-linearity is the polynomial of :mod:`crypto.he.approx` on
its calibrated range: the kernel is :math:`p(u)\\approx e^{-D u}` with
:math:`u = \\lVert q-k\\rVert^2/(2\\sqrt{d_h} D)`; the inverse square root is a degree-3
fit on :math:`[a, 1]` of :math:`s = \\sigma^2/\\text{div}` plus one Newton step.
Calibration stores the ranges in the model; :meth:`HEFormer.forward` with
``guard=True`` raises :class:`~crypto.he.approx.RangeError` when a value leaves them.
The softmax twin replaces the kernel by :math:`\\mathrm{softmax}(q k^T/\\sqrt{d_h})`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from defenses.arrays import FloatArray
from defenses.checks import check_choice, check_int

from ..he.approx import TANH_GAIN, Calibration, LayerRanges, RangeGuard

__all__ = ["Block", "Calibration", "HEFormer", "LayerRanges", "ModelConfig"]

ATTENTIONS = ("gk", "softmax")


def check_heads(owner: str, d: int, heads: int) -> None:
    """Refuse a width ``d`` that the attention ``heads`` do not divide."""
    if d % heads:
        raise ValueError(f"{owner}.d={d} must be a multiple of heads={heads}")


HEADROOM = 0.7
POOL_HEADROOM = 0.6
GUARD_SLACK = 0.05
"""The guard lets values exceed a range by 5 % of its width. In polynomial mode the
polynomial *is* the model's function (plaintext and CKKS evaluate the same one), so
the guard only has to stop divergence: on that extension the degree-7 kernel fit
stays within 1e-2 of the exponential (bound 8), the tanh fit within 0.21 (0.07
inside) and the inverse square root within 0.28 above 1."""
POOL_EXTRA = 2.0


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the HE-friendly transformer.

    Parameters
    ----------
    n_tokens, token_dim : int
        Sequence length and input feature size per token.
    d : int
        Model width; must be a multiple of ``heads``.
    heads : int
        Attention heads (head width ``d_h = d / heads``).
    ffn : int
        Hidden width of the feed-forward block.
    n_classes : int
        Output classes (>= 2).
    rank : int
        LoRA rank on Q, K, V (the paper uses 2).
    attention : {"gk", "softmax"}
        Gaussian-kernel attention or the softmax twin.
    gk_degree, isqrt_degree, tanh_degree : int
        Polynomial degrees of the kernel, inverse square root and pooler.
    personal_head : bool
        Personalisation also trains the head (pooler and classifier), as in the
        paper; the head is then the client's secret and is encrypted like LoRA.
    n_layers : int
        Transformer blocks (>= 1; the paper's BERT has 2). Each block has its own
        weights, LoRA adapters and calibrated ranges.
    """

    n_tokens: int = 8
    token_dim: int = 8
    d: int = 16
    heads: int = 2
    ffn: int = 32
    n_classes: int = 10
    rank: int = 2
    attention: str = "gk"
    gk_degree: int = 7
    isqrt_degree: int = 3
    tanh_degree: int = 3
    personal_head: bool = False
    n_layers: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.personal_head, bool):
            raise ValueError(
                f"ModelConfig.personal_head must be a bool, got {self.personal_head!r}"
            )
        names = "n_tokens token_dim d heads ffn rank gk_degree isqrt_degree tanh_degree"
        for name in (*names.split(), "n_layers"):
            check_int(f"ModelConfig.{name}", getattr(self, name), 1)
        check_int("ModelConfig.n_classes", self.n_classes, 2)
        check_heads("ModelConfig", self.d, self.heads)
        check_choice("ModelConfig.attention", self.attention, ATTENTIONS)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d // self.heads


def torch_poly(coefficients: FloatArray, x: torch.Tensor) -> torch.Tensor:
    """Horner evaluation of monomial ``coefficients`` (low to high) at ``x``."""
    out = torch.zeros_like(x)
    for c in coefficients[::-1]:
        out = out * x + float(c)
    return out


class LoRALinear(nn.Module):
    r""":math:`x \\mapsto x (W_0 + A B)` with frozen-able :math:`W_0` and rank-r LoRA.

    ``B`` starts at zero so the adapter starts as the identity update (Hu et al.,
    2022).
    """

    def __init__(self, d_in: int, d_out: int, rank: int, generator: torch.Generator):
        super().__init__()
        scale = 1.0 / math.sqrt(d_in)
        self.weight = nn.Parameter(
            torch.randn(d_in, d_out, generator=generator, dtype=torch.float64) * scale
        )
        self.lora_a = nn.Parameter(
            torch.randn(d_in, rank, generator=generator, dtype=torch.float64) * scale
        )
        self.lora_b = nn.Parameter(torch.zeros(rank, d_out, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the adapted linear map."""
        return x @ self.weight + (x @ self.lora_a) @ self.lora_b


def _linear(d_in: int, d_out: int, generator: torch.Generator) -> nn.Parameter:
    return nn.Parameter(
        torch.randn(d_in, d_out, generator=generator, dtype=torch.float64)
        / math.sqrt(d_in)
    )


Jitter = Callable[[torch.Tensor], torch.Tensor]
Check = Callable[[str, torch.Tensor, float, float], None]


class Block(nn.Module):
    """One HE-friendly block: GK attention, polynomial LayerNorm, polynomial FFN."""

    def __init__(self, config: ModelConfig, generator: torch.Generator):
        super().__init__()
        c = config
        self.config = c
        self.q = LoRALinear(c.d, c.d, c.rank, generator)
        self.k = LoRALinear(c.d, c.d, c.rank, generator)
        self.v = LoRALinear(c.d, c.d, c.rank, generator)
        self.out = _linear(c.d, c.d, generator)
        self.gamma = nn.Parameter(torch.ones(c.d, dtype=torch.float64))
        self.w1 = _linear(c.d, c.ffn, generator)
        self.act = nn.Parameter(torch.tensor([0.5, 0.1], dtype=torch.float64))
        self.w2 = _linear(c.ffn, c.d, generator)

    def heads(self, z: torch.Tensor, lin: LoRALinear, jitter: Jitter) -> torch.Tensor:
        """Project ``z`` with ``lin`` into (batch, heads, n, d_h)."""
        c = self.config
        b, n = z.shape[0], z.shape[1]
        return jitter(lin(z)).view(b, n, c.heads, c.head_dim).transpose(1, 2)

    def max_distance(self, z: torch.Tensor) -> float:
        r"""Largest :math:`\\lVert q_i - k_j\\rVert^2 / (2\\sqrt{d_h})` on ``z``."""
        q = self.heads(z, self.q, lambda t: t)
        k = self.heads(z, self.k, lambda t: t)
        dist = ((q.unsqueeze(3) - k.unsqueeze(2)) ** 2).sum(-1)
        return float(dist.max()) / (2.0 * math.sqrt(self.config.head_dim))

    def forward(
        self,
        z: torch.Tensor,
        ranges: LayerRanges,
        poly: bool,
        jitter: Jitter,
        check: Check,
        prefix: str = "",
    ) -> torch.Tensor:
        """The block's output (the next block's input); see the module docstring."""
        c = self.config
        b, n = z.shape[0], z.shape[1]
        q = self.heads(z, self.q, jitter)
        k = self.heads(z, self.k, jitter)
        v = self.heads(z, self.v, jitter)
        if c.attention == "gk":
            dist = ((q.unsqueeze(3) - k.unsqueeze(2)) ** 2).sum(-1)
            dist = dist / (2.0 * math.sqrt(c.head_dim))
            u = dist / ranges.dist_bound
            check(f"{prefix}kernel distance u", u, 0.0, 1.0)
            if poly:
                scores = torch_poly(ranges.polys["gk"].coefficients, u)
            else:
                scores = torch.exp(-dist)
        else:
            logits = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
            scores = torch.softmax(logits, dim=-1)
        attended = jitter(scores) @ v
        h = z + attended.transpose(1, 2).reshape(b, n, c.d) @ self.out
        centred = h - h.mean(-1, keepdim=True)
        variance = (centred**2).mean(-1, keepdim=True)
        s = variance / ranges.ln_div
        check(f"{prefix}LayerNorm variance s", s, ranges.ln_lo, 1.0)
        if poly:
            y = torch_poly(ranges.polys["isqrt"].coefficients, s)
            y = y * (3.0 - s * y * y) / 2.0
            u_ln = centred * y / math.sqrt(ranges.ln_div)
        else:
            u_ln = centred / torch.sqrt(variance + 1e-6)
        u_ln = jitter(u_ln * self.gamma)
        a = u_ln @ self.w1
        check(f"{prefix}activation input", a / ranges.ffn_bound, -1.0, 1.0)
        hidden = self.act[0] * a + self.act[1] * a * a
        return jitter(h + hidden @ self.w2)


def layer_prefix(layer: int) -> str:
    """Prefix of block ``layer``'s trace and guard names ("" for block 0)."""
    return f"layer {layer} " if layer else ""


class HEFormer(nn.Module):
    """HE-friendly transformer with LoRA on Q, K, V (see the module docstring).

    ``blocks`` holds the ``n_layers`` blocks; ``q``, ``k``, ``v``, ``out``,
    ``gamma``, ``w1``, ``act`` and ``w2`` name the only block's weights of a
    one-layer model (and refuse on a deeper one, where they would be ambiguous).
    """

    def __init__(self, config: ModelConfig, generator: torch.Generator):
        super().__init__()
        c = config
        self.config = c
        self.calibration = Calibration(
            layers=[LayerRanges() for _ in range(c.n_layers)]
        )
        self.embed = _linear(c.token_dim, c.d, generator)
        self.position = nn.Parameter(
            0.5 * torch.randn(c.n_tokens, c.d, generator=generator, dtype=torch.float64)
        )
        self.blocks = nn.ModuleList([Block(c, generator) for _ in range(c.n_layers)])
        self.pool = _linear(c.d, c.d, generator)
        self.classifier = _linear(c.d, c.n_classes, generator)

    def _only_block(self, name: str) -> Block:
        if self.config.n_layers != 1:
            raise ValueError(
                f"HEFormer.{name} names the weight of a one-layer model; this one has "
                f"n_layers={self.config.n_layers}: use model.blocks[i].{name}"
            )
        block: Block = self.blocks[0]  # type: ignore[assignment]
        return block

    q = property(lambda self: self._only_block("q").q)
    k = property(lambda self: self._only_block("k").k)
    v = property(lambda self: self._only_block("v").v)
    out = property(lambda self: self._only_block("out").out)
    gamma = property(lambda self: self._only_block("gamma").gamma)
    w1 = property(lambda self: self._only_block("w1").w1)
    act = property(lambda self: self._only_block("act").act)
    w2 = property(lambda self: self._only_block("w2").w2)

    def block_list(self) -> list[Block]:
        """The blocks, first to last, typed."""
        return [b for b in self.blocks if isinstance(b, Block)]

    # -- pieces shared with the encrypted evaluator ---------------------------------
    def embed_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Client-side embedding :math:`z = x W_e + P`."""
        c = self.config
        if x.ndim != 3 or x.shape[1:] != (c.n_tokens, c.token_dim):
            raise ValueError(
                f"expected sequences of shape (batch, {c.n_tokens}, {c.token_dim}), "
                f"got {tuple(x.shape)}"
            )
        return x @ self.embed + self.position

    def forward(
        self,
        x: torch.Tensor,
        poly: bool = False,
        guard: bool = False,
        noise: float = 0.0,
        generator: torch.Generator | None = None,
        trace: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits of shape (batch, n_classes).

        Parameters
        ----------
        x : Tensor
            Sequences (batch, n_tokens, token_dim).
        poly : bool
            Use the polynomial approximations (needs :meth:`calibrate` first).
        guard : bool
            Raise :class:`~crypto.he.approx.RangeError` when a polynomial's input leaves
            its calibrated range.
        noise : float
            HE simulation: standard deviation of Gaussian noise added after every
            homomorphic stage (needs ``generator``).
        trace : dict, optional
            Filled with the raw inputs of every approximated function (calibration);
            block ``l > 0``'s names start with ``"layer l "``.
        """
        if poly and not self.calibration.calibrated:
            raise RuntimeError("call calibrate() before running in polynomial mode")
        if noise and generator is None:
            raise ValueError("noise > 0 needs a torch.Generator")
        cal = self.calibration

        def jitter(t: torch.Tensor) -> torch.Tensor:
            if not noise:
                return t
            return t + noise * torch.randn(t.shape, generator=generator, dtype=t.dtype)

        def check(name: str, values: torch.Tensor, lo: float, hi: float) -> None:
            if trace is not None:
                trace[name] = values
            if guard:
                RangeGuard(name, lo, hi, slack=GUARD_SLACK)(values.detach().numpy())

        o = self.embed_tokens(x)
        for layer, block in enumerate(self.block_list()):
            o = block(o, cal.layers[layer], poly, jitter, check, layer_prefix(layer))
        t = (o[:, 0, :] @ self.pool) / cal.pool_bound
        check("pooler input t", t, -1.0, 1.0)
        if poly:
            pooled = torch_poly(cal.polys["tanh"].coefficients, t)
        else:
            pooled = torch.tanh(TANH_GAIN * t)
        result: torch.Tensor = jitter(pooled) @ self.classifier
        return result

    def range_penalty(self, trace: dict[str, torch.Tensor]) -> torch.Tensor:
        """Penalty keeping the ranges inside the current calibration.

        The analogue of the paper's variance and matmul-range penalties: squared
        excess of every approximated function's input (recorded in ``trace`` by
        :meth:`forward`, every block's) over ``HEADROOM`` times its bound, leaving
        room for unseen inputs.
        """
        cal = self.calibration
        top = HEADROOM
        total = torch.zeros((), dtype=torch.float64)
        prefixes = [layer_prefix(i) for i in range(self.config.n_layers)]
        for p, ranges in zip(prefixes, cal.layers, strict=True):
            if f"{p}kernel distance u" in trace:
                u = trace[f"{p}kernel distance u"]
                total = total + torch.relu(u - top).pow(2).mean()
            s = trace[f"{p}LayerNorm variance s"]
            total = total + torch.relu(s - top).pow(2).mean()
            total = total + torch.relu(ranges.ln_lo / top - s).pow(2).mean()
        pool = trace["pooler input t"].abs()
        total = total + torch.relu(pool - POOL_HEADROOM).pow(2).mean()
        for p in prefixes:
            a = trace[f"{p}activation input"].abs()
            total = total + torch.relu(a - top).pow(2).mean()
        return total

    def calibrate(self, x: torch.Tensor, margin: float = 1.25) -> Calibration:
        """Measure every approximated input's range on ``x`` and fit the polynomials.

        Bounds are the observed extremes times ``margin`` (> 1), block by block;
        the pooler gets an extra factor ``POOL_EXTRA`` because the frozen head meets
        the client's shifted data.
        """
        if not margin > 1:
            raise ValueError(f"margin must be > 1, got {margin!r}")
        c, cal = self.config, self.calibration
        with torch.no_grad():
            z = self.embed_tokens(x)
            dist_max = []
            for ranges, block in zip(cal.layers, self.block_list(), strict=True):
                dist_max.append(block.max_distance(z))
                ranges.dist_bound, ranges.ln_div, ranges.ffn_bound = 1.0, 1.0, 1.0
                ranges.ln_lo = 1e-12
                z = block(z, ranges, False, lambda t: t, lambda *_: None)
            cal.pool_bound = 1.0
            trace: dict[str, torch.Tensor] = {}
            self.forward(x, trace=trace)
        for layer, ranges in enumerate(cal.layers):
            p = layer_prefix(layer)
            variance = trace[f"{p}LayerNorm variance s"]
            ranges.dist_bound = max(dist_max[layer] * margin, 1e-3)
            ranges.ln_div = float(variance.max()) * margin
            lo = float(variance.min()) / ranges.ln_div / margin
            ranges.ln_lo = min(max(lo, 1e-3), 0.5)
            top = float(trace[f"{p}activation input"].abs().max())
            ranges.ffn_bound = max(top * margin, 1e-3)
        pool = float(trace["pooler input t"].abs().max())
        cal.pool_bound = max(pool * margin * POOL_EXTRA, 1e-3)
        cal.calibrated = True
        cal.fit_polys(c)
        return cal

    def base_parameters(self) -> list[nn.Parameter]:
        """Every parameter except the LoRA adapters."""
        lora = {id(p) for p in self.lora_parameters()}
        return [p for p in self.parameters() if id(p) not in lora]

    def lora_parameters(self) -> list[nn.Parameter]:
        """The LoRA factors of every block's Q, K and V."""
        return [
            p
            for b in self.block_list()
            for m in (b.q, b.k, b.v)
            for p in (m.lora_a, m.lora_b)
        ]

    def head_parameters(self) -> list[nn.Parameter]:
        """The pooler and classifier."""
        return [self.pool, self.classifier]

    def personal_parameters(self) -> list[nn.Parameter]:
        """What personalisation trains: LoRA, plus the head if ``personal_head``."""
        head = self.head_parameters() if self.config.personal_head else []
        return self.lora_parameters() + head
