r"""A model family as a value: the public weights of one encrypted program.

Both HE model families are the same program over different weights
(:mod:`crypto.program.forward`). A :class:`Program` is a stack of :class:`Block` s
and a :class:`Head`; a block is

.. math::

    h = N_a\bigl(z + \mathrm{att}(z) W_o + b_o\bigr),\qquad
    o = N_o\bigl(h + p(N_f(h) W_1 + b_1) W_2 + b_2\bigr)

with three optional polynomial LayerNorms :math:`N_a` (after attention),
:math:`N_f` (on the feed-forward branch only) and :math:`N_o` (after the
feed-forward residual), and optional biases (a bias is a plaintext add, no level).
The converted BERT (:func:`from_bert`) has :math:`N_a, N_o`, biases and several
blocks; the HEFormer (:func:`from_heformer`) is one block with :math:`N_f` only, no
biases, and a pooler/classifier head that may be the client's encrypted secret.

Every stage name the public schedule records comes from the spec (a block's
``prefix``, a norm's ``stage``, the head's ``stage``), so each family keeps its own
request names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from defenses.arrays import FloatArray

if TYPE_CHECKING:
    from .encoder import BertWeights, BlockWeights, NormWeights
    from .heformer import HEWeights

KVGrouping = Literal["kind", "shift"]


@dataclass(frozen=True)
class Norm:
    r"""A folded polynomial LayerNorm (:func:`crypto.program.blocks.layer_norm`).

    :math:`\sigma = \lVert x S\rVert^2` (``stats`` folds the centring and the
    variance's scale), :math:`y_0 = p(\sigma)` (``isqrt``), ``newton`` steps
    :math:`y \leftarrow y(c - \sigma y^2)` with :math:`c` = ``newton_shift``, and
    the output :math:`(x O)\,y + \beta` (``out``; ``None`` reuses :math:`xS`;
    ``beta`` ``None`` adds nothing). ``stage`` names its refreshes.
    """

    stats: FloatArray
    out: FloatArray | None
    beta: FloatArray | None
    isqrt: FloatArray
    newton: int
    newton_shift: float
    stage: str


@dataclass(frozen=True)
class Affine:
    r"""A public affine map :math:`x W + b`, (in, out) layout; ``bias`` may be None."""

    weight: FloatArray
    bias: FloatArray | None = None


@dataclass(frozen=True)
class Block:
    """One block's public weights, scales folded (module doc).

    ``prefix`` starts the names of the block's refresh stages and of its LoRA
    factors in the client's dictionary (``f"{prefix}q_a"``); ``gk`` and ``act``
    are the kernel's and the activation's polynomials.
    """

    prefix: str
    q: Affine
    k: Affine
    v: Affine
    o: Affine
    w1: Affine
    act: FloatArray
    w2: Affine
    gk: FloatArray
    attention_norm: Norm | None = None
    ffn_norm: Norm | None = None
    output_norm: Norm | None = None


@dataclass(frozen=True)
class Head:
    r"""The pooler :math:`p_{\tanh}(x W_p + b_p)`, the classifier :math:`x W_c + b_c`.

    A zero public matrix with the client's encrypted one in the LoRA dictionary
    (keys ``"pool"``, ``"classifier"``) is a personal head; ``stage`` names the
    pooler's refresh.
    """

    pool: Affine
    tanh: FloatArray
    classifier: Affine
    stage: str


@dataclass(frozen=True)
class Program:
    """One model family's encrypted program: sizes, blocks, head.

    ``kv_grouping`` orders the attention stage's refresh group: ``"kind"`` sends
    Q, every rolled K, then every rolled V; ``"shift"`` sends Q, then K and V of
    each shift. The order is part of the public schedule (per-ciphertext bounds).
    """

    family: str
    n_tokens: int
    d: int
    heads: int
    n_classes: int
    blocks: tuple[Block, ...]
    head: Head
    kv_grouping: KVGrouping = "shift"

    def __post_init__(self) -> None:
        if self.kv_grouping not in ("kind", "shift"):
            raise ValueError(
                f"Program.kv_grouping must be 'kind' or 'shift', got "
                f"{self.kv_grouping!r}"
            )
        if not self.blocks:
            raise ValueError("Program.blocks must hold at least one block, got 0")


def from_heformer(w: HEWeights) -> Program:
    r"""The HEFormer as a program: one block, no biases, one LayerNorm (FFN branch).

    The LayerNorm's Newton step is :math:`y(3 - s y^2)` (its 1/2 and the gain are
    folded into :math:`W_1`) and its output is the centred values times
    :math:`y` (no second matrix, no :math:`\beta`).
    """
    norm = Norm(w.centre, None, None, w.isqrt, 1, 3.0, "LayerNorm")
    q, k, v, o, w1, w2 = (Affine(m) for m in (w.wq, w.wk, w.wv, w.wo, w.w1, w.w2))
    block = Block("", q, k, v, o, w1, w.act, w2, w.gk, ffn_norm=norm)
    head = Head(Affine(w.pool), w.tanh, Affine(w.classifier), "head")
    return Program(
        "heformer", w.n_tokens, w.d, w.heads, w.n_classes, (block,), head, "kind"
    )


def bert_norm(w: NormWeights, newton: int, stage: str) -> Norm:
    r"""A converted BERT LayerNorm: its Newton step is :math:`y(3/2 - \sigma y^2)`."""
    return Norm(w.stats, w.out, w.beta, w.isqrt, newton, 1.5, stage)


def bert_block(b: BlockWeights, i: int, newton: int) -> Block:
    """Block ``i`` of a converted BERT: biases, LayerNorms after attention and FFN."""
    return Block(
        f"layer {i} ",
        Affine(b.wq, b.bq),
        Affine(b.wk, b.bk),
        Affine(b.wv, b.bv),
        Affine(b.wo, b.bo),
        Affine(b.w1, b.b1),
        b.act,
        Affine(b.w2, b.b2),
        b.gk,
        attention_norm=bert_norm(b.norm1, newton, f"layer {i} LayerNorm 1"),
        output_norm=bert_norm(b.norm2, newton, f"layer {i} LayerNorm 2"),
    )


def from_bert(w: BertWeights) -> Program:
    """The converted BERT as a program: post-LayerNorm blocks with biases."""
    blocks = tuple(bert_block(b, i, w.newton_steps) for i, b in enumerate(w.blocks))
    pool, classifier = (
        Affine(w.pool, w.pool_bias),
        Affine(w.classifier, w.classifier_bias),
    )
    head = Head(pool, w.tanh, classifier, "pooler")
    return Program("bert", w.n_tokens, w.d, w.heads, w.n_classes, blocks, head)


def depth(coefficients: FloatArray) -> int:
    """Levels :meth:`~crypto.he.evaluator.Evaluator.poly` consumes for a polynomial."""
    return math.ceil(math.log2(len(coefficients)))
