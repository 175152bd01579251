r"""The HE-friendly form of a BERT-style encoder classifier.

:func:`~crypto.conversion.convert` copies a ``transformers`` BERT classifier's weights
into :class:`HEBert`, which keeps BERT's post-LayerNorm blocks and replaces every
function CKKS cannot evaluate (Rho et al., "Encryption-Friendly LLM Architecture",
ICLR 2025, Sec. 4):

.. math::

    z^{(0)} &= \mathrm{LN}(E_w[\text{ids}] + E_p + E_t[0])
        &\text{(client side, exact)}\\
    S^h_{ij} &= m_j\, p_{gk}\big(\lVert q^h_i - k^h_j\rVert^2 / (2\sqrt{d_h} D)\big)
        \approx m_j\, e^{-\lVert q_i-k_j\rVert^2/(2\sqrt{d_h})},
        \quad q = z(W_q + A_q B_q) + b_q, \ldots\\
    h &= \widetilde{\mathrm{LN}}_1\big(z + [S^1 v^1, \ldots, S^H v^H] W_o + b_o\big)\\
    z' &= \widetilde{\mathrm{LN}}_2\big(h + p_{act}(h W_1 + b_1) W_2 + b_2\big)\\
    \text{logits} &= p_{\tanh}(z'_0 W_p + b_p)\, W_c + b_c

with the polynomial LayerNorm :math:`\widetilde{\mathrm{LN}}(x) = \gamma \odot
(x-\bar x)\, y / \sqrt{\text{div}} + \beta`, where :math:`y` is a Chebyshev fit of
:math:`s^{-1/2}` on :math:`[a, 1]` at :math:`s = \sigma^2/\text{div}` refined by
Newton steps :math:`y \leftarrow y(3 - s y^2)/2`; :math:`p_{act}` fits ReLU (the
paper's choice) or GELU and :math:`p_{\tanh}` fits tanh, each on its calibrated
range. :math:`m_j = a_j / \sum_l a_l` is the 0/1 attention mask :math:`a` divided by
the number of attended tokens: a padded key scores 0 (the paper's large negative
mask before the exponential), and the :math:`1/L` keeps the unnormalised kernel on
the scale of the softmax it replaces (with uniform scores both average the values).
Under CKKS :math:`m` is client data (it would travel encrypted with the
embeddings) and its product costs one level; the paper's additive mask before the
exponential does not fit a polynomial on a bounded range. In *exact* mode the model
evaluates the functions the polynomials stand for (exp, ReLU or GELU,
:math:`1/\sqrt{\sigma^2 + \epsilon}`, tanh); *polynomial* mode is the function CKKS
evaluates and needs :meth:`HEBert.calibrate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from defenses.arrays import FloatArray
from defenses.checks import check_choice, check_int, check_real

from ..he.approx import RangeError, RangeGuard
from ..models.heformer import GUARD_SLACK, HEADROOM, check_heads, torch_poly
from .functions import SourceFunctions, softmax_attention
from .inputs import check_ids
from .layers import HEBertLayer, layer_norm, linear
from .ranges import BertCalibration, fit_site, gelu, relu, tanh

ACTIVATIONS = ("relu", "gelu")


@dataclass(frozen=True)
class HEBertConfig:
    """Shape and approximation degrees of the converted model.

    Parameters
    ----------
    vocab_size, type_vocab_size : int
        Rows of the word and token-type embeddings.
    n_tokens : int
        The converted (fixed) sequence length; <= the source's position table.
    d, heads, ffn, n_layers, n_classes : int
        Width, attention heads, feed-forward width, blocks, classes (>= 2).
    rank : int
        LoRA rank on Q, K and V (the paper uses 2).
    activation : {"relu", "gelu"}
        What the polynomial activation fits: ReLU (the paper's substitution) or the
        source's GELU.
    gk_degree, isqrt_degree, act_degree, tanh_degree : int
        Degrees of the kernel, inverse square root, activation and pooler fits.
    newton_steps : int
        Newton refinements of the inverse square root (>= 0).
    layer_norm_eps : float
        The source's LayerNorm epsilon (exact mode, client-side embedding norm).
    position_padding_idx : int or None
        None: token ``i`` takes position ``i`` (BERT). An int ``p``: positions count
        non-padding tokens from ``p + 1`` and padding takes ``p`` (RoBERTa).
    """

    vocab_size: int
    n_tokens: int
    d: int
    heads: int
    ffn: int
    n_layers: int
    n_classes: int
    type_vocab_size: int = 2
    rank: int = 2
    activation: str = "relu"
    gk_degree: int = 7
    isqrt_degree: int = 7
    act_degree: int = 8
    tanh_degree: int = 7
    newton_steps: int = 2
    layer_norm_eps: float = 1e-12
    position_padding_idx: int | None = None

    def __post_init__(self) -> None:
        if self.position_padding_idx is not None:
            check_int("HEBertConfig.position_padding_idx", self.position_padding_idx, 0)
        names = "vocab_size n_tokens d heads ffn n_layers type_vocab_size rank"
        for name in (*names.split(), "gk_degree", "isqrt_degree", "act_degree"):
            check_int(f"HEBertConfig.{name}", getattr(self, name), 1)
        check_int("HEBertConfig.tanh_degree", self.tanh_degree, 1)
        check_int("HEBertConfig.newton_steps", self.newton_steps, 0)
        check_int("HEBertConfig.n_classes", self.n_classes, 2)
        check_choice("HEBertConfig.activation", self.activation, ACTIVATIONS)
        check_heads("HEBertConfig", self.d, self.heads)
        check_real(
            "HEBertConfig.layer_norm_eps", self.layer_norm_eps, 0.0, open_low=True
        )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d // self.heads

    @property
    def positions(self) -> int:
        """Rows of the position table the converted model keeps."""
        pad = self.position_padding_idx
        return self.n_tokens if pad is None else self.n_tokens + pad + 1


Site = Callable[[str, torch.Tensor], torch.Tensor]
Record = Callable[[str, torch.Tensor], torch.Tensor]
"""Sees a named intermediate output and returns it (the self-check's tap)."""


def _ignore(name: str, value: torch.Tensor) -> torch.Tensor:
    return value


class HEBert(nn.Module):
    """A BERT-style classifier in HE-friendly form (see the module docstring)."""

    def __init__(self, config: HEBertConfig, generator: torch.Generator):
        super().__init__()
        c = config
        self.config = c
        self.calibration = BertCalibration()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.d, dtype=torch.float64)
        self.position_embeddings = nn.Parameter(
            torch.zeros(c.positions, c.d, dtype=torch.float64)
        )
        self.token_type_embeddings = nn.Embedding(
            c.type_vocab_size, c.d, dtype=torch.float64
        )
        self.embedding_norm = layer_norm(c.d)
        self.layers = nn.ModuleList(
            [HEBertLayer(c.d, c.ffn, c.rank, generator) for _ in range(c.n_layers)]
        )
        self.pooler = linear(c.d, c.d)
        self.classifier = linear(c.d, c.n_classes)

    def get_extra_state(self) -> dict[str, object]:
        """The calibration, so that ``state_dict`` round-trips the deployed model."""
        cal = self.calibration
        return {
            "ranges": {k: list(v) for k, v in cal.ranges.items()},
            "polys": {k: v.tolist() for k, v in cal.polys.items()},
            "calibrated": cal.calibrated,
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """Restore the calibration saved by :meth:`get_extra_state`."""
        self.calibration = BertCalibration(
            {k: (float(v[0]), float(v[1])) for k, v in state["ranges"].items()},
            {k: np.asarray(v, dtype=np.float64) for k, v in state["polys"].items()},
            bool(state["calibrated"]),
        )

    def block_list(self) -> list[HEBertLayer]:
        """The blocks, first to last, typed."""
        return [b for b in self.layers if isinstance(b, HEBertLayer)]

    def check_ids(
        self, ids: npt.ArrayLike, mask: npt.ArrayLike | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` and ``mask`` as (batch, n_tokens) tensors, or a clear error."""
        c = self.config
        return check_ids(ids, mask, c.n_tokens, c.vocab_size)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Client-side embedding (exact LayerNorm, in plaintext on the client)."""
        pad = self.config.position_padding_idx
        if pad is None:
            z = self.word_embeddings(ids) + self.position_embeddings
        else:
            real = (ids != pad).to(torch.int64)
            z = self.word_embeddings(ids)
            z = z + self.position_embeddings[torch.cumsum(real, 1) * real + pad]
        z = z + self.token_type_embeddings.weight[0]
        norm = self.embedding_norm
        return nn.functional.layer_norm(
            z, (self.config.d,), norm.weight, norm.bias, self.config.layer_norm_eps
        )

    def _norm(
        self, x: torch.Tensor, norm: nn.LayerNorm, name: str, site: Site, poly: bool
    ) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        variance = (centred**2).mean(-1, keepdim=True)
        if not poly:
            site(name, variance)
            inv = 1.0 / torch.sqrt(variance + self.config.layer_norm_eps)
        else:
            div = self.calibration.ranges[name][1]
            s = site(name, variance)
            y = torch_poly(self.calibration.polys[name], s)
            for _ in range(self.config.newton_steps):
                y = y * (3.0 - s * y * y) / 2.0
            inv = y / math.sqrt(div)
        return centred * inv * norm.weight + norm.bias

    def encode(
        self,
        z: torch.Tensor,
        mask: torch.Tensor,
        poly: bool,
        site: Site,
        source: SourceFunctions | None = None,
        record: Record | None = None,
    ) -> torch.Tensor:
        """Logits from client-side embeddings ``z`` (the server's part).

        With ``source`` (the self-check) the same structure runs the source's own
        functions instead: softmax attention with the padding mask and each block's
        installed activation; ``record(name, output)`` sees each block's attention,
        intermediate and output, the pooler's dense output and the logits.
        """
        c = self.config
        b, n = z.shape[0], z.shape[1]
        keep = record or _ignore
        for i, layer in enumerate(self.block_list()):

            def split(t: torch.Tensor) -> torch.Tensor:
                return t.view(b, n, c.heads, c.head_dim).transpose(1, 2)

            q, k, v = split(layer.query(z)), split(layer.key(z)), split(layer.value(z))
            if source is not None:
                scores = softmax_attention(q, k, mask, c.head_dim**-0.5)
            else:
                dist = ((q.unsqueeze(3) - k.unsqueeze(2)) ** 2).sum(-1)
                dist = dist / (2.0 * math.sqrt(c.head_dim))
                name = f"layer {i} kernel distance"
                u = site(name, dist)
                if poly:
                    scores = torch_poly(self.calibration.polys[name], u)
                else:
                    scores = torch.exp(-dist)
                weight = mask / mask.sum(-1, keepdim=True)
                scores = scores * weight[:, None, None, :]
            attended = (scores @ v).transpose(1, 2).reshape(b, n, c.d)
            h = z + layer.attention_dense(attended)
            name = f"layer {i} attention LayerNorm variance"
            h = keep(
                f"layer {i} attention",
                self._norm(h, layer.attention_norm, name, site, poly),
            )
            a = layer.intermediate(h)
            if source is not None:
                act = source.activations[i].function(a)
            else:
                t = site(f"layer {i} activation input", a)
                if poly:
                    act = torch_poly(
                        self.calibration.polys[f"layer {i} activation input"], t
                    )
                elif c.activation == "relu":
                    act = torch.relu(a)
                else:
                    act = nn.functional.gelu(a)
            out = h + layer.output_dense(keep(f"layer {i} intermediate", act))
            name = f"layer {i} output LayerNorm variance"
            z = keep(f"layer {i}", self._norm(out, layer.output_norm, name, site, poly))
        pre = keep("pooler dense", self.pooler(z[:, 0, :]))
        t = site("pooler input", pre) if source is None else pre
        pooled = (
            torch_poly(self.calibration.polys["pooler input"], t)
            if poly and source is None
            else torch.tanh(pre)
        )
        result: torch.Tensor = keep("logits", self.classifier(pooled))
        return result

    def forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        poly: bool = False,
        guard: bool = False,
        trace: dict[str, torch.Tensor] | None = None,
        clip: bool = False,
    ) -> torch.Tensor:
        """Logits (batch, n_classes) of token ``ids`` (batch, n_tokens).

        Parameters
        ----------
        ids, mask : Tensor
            Token ids and the 0/1 attention mask (None: every position attended).
        poly : bool
            Evaluate the polynomials (needs :meth:`calibrate`).
        guard : bool
            Raise :class:`~crypto.he.approx.RangeError` naming the site when a
            polynomial's input leaves its calibrated range.
        trace : dict, optional
            Filled with every site's normalised input (raw input before calibration).
        clip : bool
            Training only: clamp every normalised input to its range before the
            polynomial (``trace`` keeps the unclamped value for the range penalty),
            so a step that leaves a range cannot make a polynomial diverge.
        """
        cal = self.calibration
        if (poly or guard) and not cal.calibrated:
            raise RuntimeError("call calibrate() before running in polynomial mode")
        if mask is None:
            mask = torch.ones(ids.shape, dtype=torch.float64)

        def site(name: str, raw: torch.Tensor) -> torch.Tensor:
            if not cal.calibrated:
                if trace is not None:
                    trace[name] = raw
                return raw
            value = raw / cal.ranges[name][1]
            if trace is not None:
                trace[name] = value
            low = cal.normalised_low(name)
            if guard:
                RangeGuard(name, low, 1.0, slack=GUARD_SLACK)(value.detach().numpy())
            return value.clamp(low, 1.0) if clip else value

        return self.encode(self.embed_tokens(ids), mask.to(torch.float64), poly, site)

    def calibrate(
        self,
        ids: npt.ArrayLike,
        mask: npt.ArrayLike | None = None,
        margin: float = 1.25,
    ) -> BertCalibration:
        """Measure every site's range on ``ids`` (exact mode) and fit the polynomials.

        Each bound is the observed extreme times ``margin`` (> 1) (a LayerNorm's
        lower end divided by it); the polynomials fit on the normalised inputs.
        """
        if not margin > 1:
            raise ValueError(f"margin must be > 1, got {margin!r}")
        ids_t, mask_t = self.check_ids(ids, mask)
        c, cal = self.config, self.calibration
        cal.calibrated = False
        trace: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            self.forward(ids_t, mask_t, trace=trace)
        ranges, polys = {}, {}
        act = relu if c.activation == "relu" else gelu
        for name, raw in trace.items():
            function: Callable[[FloatArray], FloatArray] | None = None
            if "LayerNorm" in name:
                degree = c.isqrt_degree
            elif "kernel" in name:
                degree = c.gk_degree
            elif name == "pooler input":
                degree, function = c.tanh_degree, tanh
            else:
                degree, function = c.act_degree, act
            values = np.asarray(raw.detach().numpy(), dtype=np.float64)
            ranges[name], polys[name] = fit_site(name, values, margin, degree, function)
        cal.ranges, cal.polys, cal.calibrated = ranges, polys, True
        return cal

    def range_penalty(self, trace: dict[str, torch.Tensor]) -> torch.Tensor:
        """Squared excess of every site's normalised input over ``HEADROOM``.

        The paper's range penalties (Sec. 4.2): keep inputs inside the polynomial
        domains during fine-tuning, with room for unseen data.
        """
        total = torch.zeros((), dtype=torch.float64)
        for name, value in trace.items():
            total = total + torch.relu(value.abs() - HEADROOM).pow(2).mean()
            if "LayerNorm" in name:
                lo, hi = self.calibration.ranges[name]
                total = total + torch.relu(lo / hi / HEADROOM - value).pow(2).mean()
        return total

    def lora_parameters(self) -> list[nn.Parameter]:
        """The LoRA factors of every block's Q, K and V."""
        return [
            p
            for layer in self.block_list()
            for m in (layer.query, layer.key, layer.value)
            for p in (m.lora_a, m.lora_b)
        ]

    def out_of_range(
        self, ids: npt.ArrayLike, mask: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.bool_]:
        """Which sequences the guard refuses (some site outside its range)."""
        ids_t, mask_t = self.check_ids(ids, mask)
        trace: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            self.forward(ids_t, mask_t, poly=True, trace=trace)
        bad = torch.zeros(ids_t.shape[0], dtype=torch.bool)
        for name, value in trace.items():
            low = self.calibration.normalised_low(name)
            tol = GUARD_SLACK * (1.0 - low)
            flat = value.reshape(value.shape[0], -1)
            bad |= ~torch.isfinite(flat).all(1)
            bad |= (flat.amax(1) > 1.0 + tol) | (flat.amin(1) < low - tol)
        return np.asarray(bad.numpy(), dtype=np.bool_)

    def predict_logits(
        self, ids: npt.ArrayLike, mask: npt.ArrayLike | None = None, guard: bool = True
    ) -> FloatArray:
        """Logits of the deployed (polynomial) model, float64; the guard is on."""
        ids_t, mask_t = self.check_ids(ids, mask)
        with torch.no_grad():
            try:
                out = self.forward(ids_t, mask_t, poly=True, guard=guard)
            except RangeError as err:
                raise RangeError(
                    f"ids leave the converted model's calibrated ranges: {err}"
                ) from None
        return np.asarray(out.numpy(), dtype=np.float64)
