r"""The converted BERT's public weights and secret factors for the one program.

The program itself is :mod:`crypto.program` (the converted BERT as a value:
:func:`crypto.program.from_bert`); :func:`forward`,
:func:`layer_norm` and :func:`affine` here are thin uses of it, kept for their
callers. :func:`forward` evaluates :meth:`crypto.conversion.model.HEBert.encode` in the
rotation-free layout of :mod:`crypto.he.packing` (one value per feature, slot
``b n + i`` = token ``i`` of sequence ``b``), through the level-tracking
:class:`~crypto.he.evaluator.Evaluator`, on any backend (NumpyBackend or TenSEAL).
Per block, with public plaintext matrices and biases (a bias is a plaintext add,
no level) and the client's encrypted LoRA factors:

.. math::

    q' = \kappa(z W_q^T + b_q) + (z \kappa A_q) B_q,\quad
    k' = \ldots,\quad v = z W_v^T + b_v + (z A_v) B_v,
    \qquad \kappa = (2\sqrt{d_h} D)^{-1/2}

so the kernel polynomial's input is :math:`u_s = \sum_{f\in h}(q'_f - k'_{s,f})^2
\in [0, 1]`; the client rolls K and V (:func:`crypto.program.gk_attention` then
reads rolled copy ``s``), and the attention mask enters as the client's encrypted
key weights :math:`M_s[bn+i] = m_{b,(i+s) \bmod n} / \sum_j m_{b,j}`, multiplied
into the rolled values (:math:`\sum_s p(u_s)\,(M_s v_{s,f})`, the mask product
:math:`m_j/L` of HEBert).

Each polynomial LayerNorm (:func:`layer_norm`) computes
:math:`\sigma = \tfrac12 \mathrm{var}(x)/\text{div}` from the centred values
scaled by :math:`(2 d\,\text{div})^{-1/2}` (one public matrix), evaluates the
inverse-square-root fit at :math:`2\sigma` (coefficients :math:`c_k 2^k`), refines
it by Newton steps :math:`y \leftarrow y(3/2 - \sigma y^2)` (the 1/2 folded into
:math:`\sigma`), and returns :math:`(x-\bar x)\gamma/\sqrt{\text{div}}\cdot y + \beta`
(a second public matrix). The activation's :math:`1/B` is folded into
:math:`W_1, b_1`, the pooler's :math:`1/B_p` into :math:`W_p, b_p`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from defenses.arrays import FloatArray

from .. import program
from ..he.evaluator import Evaluator, Roll, Value
from . import blocks
from .blocks import affine
from .forward import Run, Trace
from .spec import bert_norm, depth, from_bert

__all__ = [
    "LORA",
    "BertWeights",
    "BlockWeights",
    "NormWeights",
    "affine",
    "depth",
    "forward",
    "layer_norm",
    "lora_factors",
]

LORA = ("q", "k", "v")


@dataclass(frozen=True)
class NormWeights:
    r"""A folded polynomial LayerNorm: statistics and output matrices, beta, fit."""

    stats: FloatArray
    out: FloatArray
    beta: FloatArray
    isqrt: FloatArray


@dataclass(frozen=True)
class BlockWeights:
    """One block's public weights, in (in, out) layout, scales folded."""

    wq: FloatArray
    bq: FloatArray
    wk: FloatArray
    bk: FloatArray
    wv: FloatArray
    bv: FloatArray
    wo: FloatArray
    bo: FloatArray
    norm1: NormWeights
    w1: FloatArray
    b1: FloatArray
    act: FloatArray
    w2: FloatArray
    b2: FloatArray
    norm2: NormWeights
    gk: FloatArray
    kappa: float


@dataclass(frozen=True)
class BertWeights:
    """The public, HE-ready weights of a calibrated :class:`HEBert` (module doc)."""

    n_tokens: int
    d: int
    heads: int
    n_classes: int
    newton_steps: int
    blocks: tuple[BlockWeights, ...]
    pool: FloatArray
    pool_bias: FloatArray
    tanh: FloatArray
    classifier: FloatArray
    classifier_bias: FloatArray

    @classmethod
    def from_model(cls, model: object) -> BertWeights:
        """Extract and fold the weights of a calibrated converted model."""
        from ..conversion.model import HEBert

        if not isinstance(model, HEBert):
            raise TypeError(f"model must be an HEBert, got {type(model).__name__}")
        c, cal = model.config, model.calibration
        if not cal.calibrated:
            raise ValueError("calibrate the converted model before extracting weights")

        def a(t: object) -> FloatArray:
            return np.asarray(t.detach().numpy(), dtype=np.float64).copy()  # type: ignore[attr-defined]

        def norm(layer_norm: object, site: str) -> NormWeights:
            div = cal.ranges[site][1]
            centre = np.eye(c.d) - 1.0 / c.d
            gamma = a(layer_norm.weight)  # type: ignore[attr-defined]
            powers = 2.0 ** np.arange(len(cal.polys[site]))
            return NormWeights(
                stats=centre / math.sqrt(2.0 * c.d * div),
                out=centre * gamma[None, :] / math.sqrt(div),
                beta=a(layer_norm.bias),  # type: ignore[attr-defined]
                isqrt=cal.polys[site] * powers,
            )

        blocks = []
        for i, layer in enumerate(model.block_list()):
            top = cal.ranges[f"layer {i} kernel distance"][1]
            kappa = 1.0 / math.sqrt(2.0 * math.sqrt(c.head_dim) * top)
            bound = cal.ranges[f"layer {i} activation input"][1]
            blocks.append(
                BlockWeights(
                    wq=a(layer.query.weight).T * kappa,
                    bq=a(layer.query.bias) * kappa,
                    wk=a(layer.key.weight).T * kappa,
                    bk=a(layer.key.bias) * kappa,
                    wv=a(layer.value.weight).T,
                    bv=a(layer.value.bias),
                    wo=a(layer.attention_dense.weight).T,
                    bo=a(layer.attention_dense.bias),
                    norm1=norm(
                        layer.attention_norm, f"layer {i} attention LayerNorm variance"
                    ),
                    w1=a(layer.intermediate.weight).T / bound,
                    b1=a(layer.intermediate.bias) / bound,
                    act=cal.polys[f"layer {i} activation input"].copy(),
                    w2=a(layer.output_dense.weight).T,
                    b2=a(layer.output_dense.bias),
                    norm2=norm(
                        layer.output_norm, f"layer {i} output LayerNorm variance"
                    ),
                    gk=cal.polys[f"layer {i} kernel distance"].copy(),
                    kappa=kappa,
                )
            )
        pool_bound = cal.ranges["pooler input"][1]
        return cls(
            n_tokens=c.n_tokens,
            d=c.d,
            heads=c.heads,
            n_classes=c.n_classes,
            newton_steps=c.newton_steps,
            blocks=tuple(blocks),
            pool=a(model.pooler.weight).T / pool_bound,
            pool_bias=a(model.pooler.bias) / pool_bound,
            tanh=cal.polys["pooler input"].copy(),
            classifier=a(model.classifier.weight).T,
            classifier_bias=a(model.classifier.bias),
        )


def lora_factors(model: object) -> dict[str, FloatArray]:
    r"""The client's secret LoRA factors, ``"layer {i} q_a"`` ..., :math:`\kappa` in A.

    :math:`\kappa` of block ``i`` (from its calibrated kernel range) is folded into
    the ``A`` factors of Q and K, as into the public :math:`W_q, W_k`.
    """
    from ..conversion.model import HEBert

    if not isinstance(model, HEBert):
        raise TypeError(f"model must be an HEBert, got {type(model).__name__}")
    c, cal = model.config, model.calibration
    out = {}
    for i, layer in enumerate(model.block_list()):
        top = cal.ranges[f"layer {i} kernel distance"][1]
        kappa = 1.0 / math.sqrt(2.0 * math.sqrt(c.head_dim) * top)
        for name, m, s in (
            ("q", layer.query, kappa),
            ("k", layer.key, kappa),
            ("v", layer.value, 1.0),
        ):
            lora_a = np.asarray(m.lora_a.detach().numpy(), dtype=np.float64)
            lora_b = np.asarray(m.lora_b.detach().numpy(), dtype=np.float64)
            out[f"layer {i} {name}_a"] = lora_a * s
            out[f"layer {i} {name}_b"] = lora_b.copy()
    return out


def layer_norm(
    ev: Evaluator, x: list[Value], w: NormWeights, newton: int, stage: str
) -> list[Value]:
    """The polynomial LayerNorm of the module docstring on packed features."""
    return blocks.layer_norm(ev, x, bert_norm(w, newton, stage))


def forward(
    ev: Evaluator,
    w: BertWeights,
    z: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll,
    trace: Trace | None = None,
) -> list[Value]:
    """Logits on every slot from the client's embeddings ``z`` (the CLS slots count).

    ``masks`` are the ``n`` key-weight values :math:`M_s` (module docstring);
    ``roll`` asks the key owner for rolled fresh copies of K and V. The program of
    :func:`crypto.program.forward` on :func:`crypto.program.from_bert`.
    """
    return program.forward(Run(ev, lora, roll, None, masks, trace), from_bert(w), z)
