r"""The converted BERT's server-side program on feature-major packed values.

:func:`forward` evaluates :meth:`crypto.conversion.model.HEBert.encode` in the
rotation-free layout of :mod:`crypto.packing` (one value per feature, slot
``b n + i`` = token ``i`` of sequence ``b``), through the level-tracking
:class:`~crypto.evaluator.Evaluator`, on any backend (NumpyBackend or TenSEAL).
Per block, with public plaintext matrices and biases (a bias is a plaintext add,
no level) and the client's encrypted LoRA factors:

.. math::

    q' = \kappa(z W_q^T + b_q) + (z \kappa A_q) B_q,\quad
    k' = \ldots,\quad v = z W_v^T + b_v + (z A_v) B_v,
    \qquad \kappa = (2\sqrt{d_h} D)^{-1/2}

so the kernel polynomial's input is :math:`u_s = \sum_{f\in h}(q'_f - k'_{s,f})^2
\in [0, 1]`; the client rolls K and V (:func:`crypto.heval.gk_attention` then
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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from defenses.arrays import FloatArray

from .evaluator import Evaluator, Roll, Value
from .heval import gk_attention

LORA = ("q", "k", "v")


def depth(coefficients: FloatArray) -> int:
    """Levels :meth:`~crypto.evaluator.Evaluator.poly` consumes for a polynomial."""
    return math.ceil(math.log2(len(coefficients)))


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
        from .conversion.model import HEBert

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
    from .conversion.model import HEBert

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


def affine(
    ev: Evaluator, xs: Sequence[Value], W: FloatArray, b: FloatArray
) -> list[Value]:
    r""":math:`y_f = \sum_g x_g W_{gf} + b_f` (public W and b; one level)."""
    return [
        ev.shift(y, float(bias)) for y, bias in zip(ev.linear(xs, W), b, strict=True)
    ]


def layer_norm(
    ev: Evaluator, x: list[Value], w: NormWeights, newton: int, stage: str
) -> list[Value]:
    """The polynomial LayerNorm of the module docstring on packed features."""
    x = ev.ensure(x, 2, f"{stage} statistics")
    centred = ev.linear(x, w.stats)
    scaled = ev.linear(x, w.out)
    sigma = ev.total([ev.square(c) for c in centred])
    [sigma] = ev.ensure([sigma], depth(w.isqrt), f"{stage} inverse sqrt")
    y = ev.poly(sigma, w.isqrt)
    for _ in range(newton):
        sigma, y = ev.ensure([sigma, y], 3, f"{stage} Newton")
        y = ev.mul(y, ev.shift(ev.neg(ev.mul(sigma, ev.square(y))), 1.5))
    both = ev.ensure([*scaled, y], 1, f"{stage} scale")
    return [
        ev.shift(ev.mul(s, both[-1]), float(b))
        for s, b in zip(both[:-1], w.beta, strict=True)
    ]


def _mapped(
    ev: Evaluator,
    x: list[Value],
    W: FloatArray,
    b: FloatArray,
    coefficients: FloatArray,
    stage: str,
) -> list[Value]:
    """``p(x W + b)``, refreshing ``x`` once if the chain allows, else in two steps."""
    need = 1 + depth(coefficients)
    if need + 1 <= ev.max_level:  # room for the next linear map too
        x = ev.ensure(x, need + 1, stage)
        return [ev.poly(t, coefficients) for t in affine(ev, x, W, b)]
    x = ev.ensure(x, 1, stage)
    pre = ev.ensure(affine(ev, x, W, b), depth(coefficients), f"{stage} polynomial")
    return [ev.poly(t, coefficients) for t in pre]


def _attention(
    ev: Evaluator,
    w: BertWeights,
    bw: BlockWeights,
    z: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll,
    i: int,
) -> list[Value]:
    """Block ``i``'s masked Gaussian-kernel attention, projected (``z``'s level + 1)."""
    d, n = w.d, w.n_tokens
    z = ev.ensure(z, 2, f"layer {i} qkv")
    proj = {}
    for name, W, b in (("q", bw.wq, bw.bq), ("k", bw.wk, bw.bk), ("v", bw.wv, bw.bv)):
        low = ev.lora(z, W, lora[f"layer {i} {name}_a"], lora[f"layer {i} {name}_b"])
        proj[name] = [ev.shift(y, float(c)) for y, c in zip(low, b, strict=True)]
    rolled = roll(proj["k"] + proj["v"], n)
    ev.note("roll_rounds")
    flat = proj["q"] + [x for r in rolled for x in r]
    flat = ev.ensure(flat, 5, f"layer {i} attention")
    q = flat[:d]
    copies = [flat[d + s * 2 * d : d + (s + 1) * 2 * d] for s in range(n)]
    ks = [c[:d] for c in copies]
    vs = [[ev.mul(x, masks[s]) for x in c[d:]] for s, c in enumerate(copies)]
    attended = gk_attention(ev, q, ks, vs, w.heads, bw.gk)
    return ev.ensure(attended, 1, f"layer {i} output projection")


def forward(
    ev: Evaluator,
    w: BertWeights,
    z: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll,
) -> list[Value]:
    """Logits on every slot from the client's embeddings ``z`` (the CLS slots count).

    ``masks`` are the ``n`` key-weight values :math:`M_s` (module docstring);
    ``roll`` asks the key owner for rolled fresh copies of K and V.
    """
    pooled = encode(ev, w, z, masks, lora, roll)
    pooled = ev.ensure(pooled, 1, "classifier")
    return affine(ev, pooled, w.classifier, w.classifier_bias)


def encode(
    ev: Evaluator,
    w: BertWeights,
    z: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll,
) -> list[Value]:
    """The pooler's output on every slot (the encoder and the tanh pooler)."""
    d, n = w.d, w.n_tokens
    if len(z) != d:
        raise ValueError(f"expected {d} feature values, got {len(z)}")
    if len(masks) != n:
        raise ValueError(f"expected {n} key-weight values, got {len(masks)}")
    for i, bw in enumerate(w.blocks):
        attended = _attention(ev, w, bw, z, masks, lora, roll, i)
        projected = affine(ev, attended, bw.wo, bw.bo)
        h = [ev.add(a, b) for a, b in zip(z, projected, strict=True)]
        h = layer_norm(ev, h, bw.norm1, w.newton_steps, f"layer {i} LayerNorm 1")
        hidden = _mapped(ev, h, bw.w1, bw.b1, bw.act, f"layer {i} feed-forward")
        hidden = ev.ensure(hidden, 1, f"layer {i} feed-forward output")
        ffn = affine(ev, hidden, bw.w2, bw.b2)
        out = [ev.add(a, b) for a, b in zip(h, ffn, strict=True)]
        z = layer_norm(ev, out, bw.norm2, w.newton_steps, f"layer {i} LayerNorm 2")
    return _mapped(ev, z, w.pool, w.pool_bias, w.tanh, "pooler")
