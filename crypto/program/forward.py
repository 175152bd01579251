r"""One encrypted forward program for every model family (:mod:`crypto.program.spec`).

Values are feature-major packed (:mod:`crypto.packing`: one value per feature, slot
``b n + i`` = token ``i`` of sequence ``b``) and evaluated by the level-tracking
:class:`~crypto.evaluator.Evaluator` on any backend (NumpyBackend or TenSEAL). Per
block, with public matrices, optional plaintext biases and the client's encrypted
LoRA factors (``lora[f"{prefix}q_a"]`` ...):

.. math::

    q = z W_q + b_q + (z A_q) B_q,\ \ldots,\qquad
    \mathrm{att}_f = \sum_s p\Bigl(\sum_{f'\in h}(q_{f'} - k_{s,f'})^2\Bigr)
        \,(M_s\, v_{s,f})

where :math:`\kappa` is folded into Q and K, copy ``s`` of K and V is rolled by the
key owner (``roll``, interactive) or projected from the client's rolled embeddings
(``rolled_z``, non-interactive, one block), and the optional key weights
:math:`M_s` carry the attention mask. The rest of the block and the head follow
:class:`~crypto.program.spec.Block` and :class:`~crypto.program.spec.Head`.

The program has no branch on a value: which refreshes and rolls it requests is a
function of the spec and the chain, which is what lets the client derive the
public schedule on zeros. ``trace`` (optional) receives the activations of every
stage, named ``f"{prefix}{site}"``, for a backward pass to read.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..evaluator import Evaluator, Roll, Value
from .attention import gk_attention
from .blocks import layer_norm, mapped, project, residual
from .spec import Block, Program

Lora = dict[str, list[list[Value]]]
Trace = dict[str, list[Value]]

ATTENTION_LEVELS = 5
"""Levels of the attention stage: distance (1), kernel (3), weighting (1)."""


def _keep(trace: Trace | None, name: str, values: Sequence[Value]) -> None:
    if trace is not None:
        trace[name] = list(values)


def _qkv(ev: Evaluator, b: Block, z: list[Value], name: str, lora: Lora) -> list[Value]:
    W, bias = {"q": (b.wq, b.bq), "k": (b.wk, b.bk), "v": (b.wv, b.bv)}[name]
    low = ev.lora(z, W, lora[f"{b.prefix}{name}_a"], lora[f"{b.prefix}{name}_b"])
    if bias is None:
        return low
    return [ev.shift(y, float(c)) for y, c in zip(low, bias, strict=True)]


def attention(
    ev: Evaluator,
    p: Program,
    b: Block,
    z: list[Value],
    lora: Lora,
    roll: Roll | None,
    rolled_z: list[list[Value]] | None = None,
    masks: list[Value] | None = None,
    trace: Trace | None = None,
) -> list[Value]:
    """The block's attention output, ready for the output projection (1 level)."""
    d, n, pre = p.d, p.n_tokens, b.prefix
    zq = ev.ensure(z, 2, f"{pre}qkv")
    q = _qkv(ev, b, zq, "q", lora)
    if rolled_z is None:
        if roll is None:
            raise ValueError("give roll (interactive) or rolled_z")
        k, v = _qkv(ev, b, zq, "k", lora), _qkv(ev, b, zq, "v", lora)
        rolled = roll(k + v, n)
        ev.note("roll_rounds")
        ks, vs = [r[:d] for r in rolled], [r[d:] for r in rolled]
    else:
        ks, vs = [], []
        for zs in rolled_z:
            zs = ev.ensure(zs, 2, f"{pre}qkv")
            ks.append(_qkv(ev, b, zs, "k", lora))
            vs.append(_qkv(ev, b, zs, "v", lora))
    if p.kv_grouping == "kind":
        flat = q + [x for r in ks for x in r] + [x for r in vs for x in r]
        flat = ev.ensure(flat, ATTENTION_LEVELS, f"{pre}attention")
        ks = [flat[d + s * d : d + (s + 1) * d] for s in range(n)]
        vs = [flat[d + n * d + s * d : d + n * d + (s + 1) * d] for s in range(n)]
    else:
        flat = q + [x for s in range(n) for x in ks[s] + vs[s]]
        flat = ev.ensure(flat, ATTENTION_LEVELS, f"{pre}attention")
        copies = [flat[d + s * 2 * d : d + (s + 1) * 2 * d] for s in range(n)]
        ks, vs = [c[:d] for c in copies], [c[d:] for c in copies]
    q = flat[:d]
    if masks is not None:
        vs = [[ev.mul(x, masks[s]) for x in row] for s, row in enumerate(vs)]
    _keep(trace, f"{pre}q", q)
    _keep(trace, f"{pre}k", [x for r in ks for x in r])
    _keep(trace, f"{pre}v", [x for r in vs for x in r])
    attended = gk_attention(ev, q, ks, vs, p.heads, b.gk)
    attended = ev.ensure(attended, 1, f"{pre}output projection")
    _keep(trace, f"{pre}attended", attended)
    return attended


def block(
    ev: Evaluator,
    p: Program,
    b: Block,
    z: list[Value],
    lora: Lora,
    roll: Roll | None,
    rolled_z: list[list[Value]] | None = None,
    masks: list[Value] | None = None,
    trace: Trace | None = None,
) -> list[Value]:
    """One block (:class:`~crypto.program.spec.Block`): the next block's input."""
    pre = b.prefix
    _keep(trace, f"{pre}input", z)
    attended = attention(ev, p, b, z, lora, roll, rolled_z, masks, trace)
    h = residual(ev, z, project(ev, attended, b.wo, b.bo))
    if b.attention_norm is not None:
        h = layer_norm(ev, h, b.attention_norm)
    u = h
    if b.ffn_norm is not None:  # the residual keeps the refreshed h
        h = ev.ensure(h, 2, f"{b.ffn_norm.stage} statistics")
        u = layer_norm(ev, h, b.ffn_norm)
    _keep(trace, f"{pre}h", h)
    _keep(trace, f"{pre}normed", u)
    hidden = mapped(ev, u, b.w1, b.b1, b.act, f"{pre}feed-forward")
    hidden = ev.ensure(hidden, 1, f"{pre}feed-forward output")
    _keep(trace, f"{pre}hidden", hidden)
    out = residual(ev, h, project(ev, hidden, b.w2, b.b2))
    if b.output_norm is not None:
        out = layer_norm(ev, out, b.output_norm)
    _keep(trace, f"{pre}output", out)
    return out


def encode(
    ev: Evaluator,
    p: Program,
    z: list[Value],
    lora: Lora,
    roll: Roll | None = None,
    rolled_z: list[list[Value]] | None = None,
    masks: list[Value] | None = None,
    trace: Trace | None = None,
) -> list[Value]:
    """The pooler's output on every slot (every block, then the tanh pooler).

    Give ``roll`` (the key owner returns rolled fresh copies of K and V) or, for a
    one-block program, ``rolled_z`` (the client uploaded rolled copies of its
    embeddings); ``masks`` are the ``n`` key-weight values of a padding mask.
    """
    d, n = p.d, p.n_tokens
    if (roll is None) == (rolled_z is None):
        raise ValueError("give exactly one of roll (interactive) or rolled_z")
    if len(z) != d:
        raise ValueError(f"expected {d} feature values, got {len(z)}")
    if masks is not None and len(masks) != n:
        raise ValueError(f"expected {n} key-weight values, got {len(masks)}")
    if rolled_z is not None:
        if len(p.blocks) != 1:
            raise ValueError(
                f"rolled_z serves a one-block program; this one has {len(p.blocks)}"
            )
        if len(rolled_z) != n:
            raise ValueError(f"expected {n} rolled copies, got {len(rolled_z)}")
    for b in p.blocks:
        z = block(ev, p, b, z, lora, roll, rolled_z, masks, trace)
    pooled = mapped(
        ev, z, p.head.pool, p.head.pool_bias, p.head.tanh, p.head.stage,
        lora.get("pool"),
    )  # fmt: skip
    _keep(trace, "pooled", pooled)
    return pooled


def forward(
    ev: Evaluator,
    p: Program,
    z: list[Value],
    lora: Lora,
    roll: Roll | None = None,
    rolled_z: list[list[Value]] | None = None,
    masks: list[Value] | None = None,
    trace: Trace | None = None,
) -> list[Value]:
    """Logits on every slot (the CLS slots are the answer); arguments of :func:`encode`.

    The classifier is public (``p.head.classifier``) or the client's encrypted
    ``lora["classifier"]``.
    """
    pooled = encode(ev, p, z, lora, roll, rolled_z, masks, trace)
    pooled = ev.ensure(pooled, 1, "classifier")
    h = p.head
    logits = project(
        ev, pooled, h.classifier, h.classifier_bias, lora.get("classifier")
    )
    _keep(trace, "logits", logits)
    return logits
