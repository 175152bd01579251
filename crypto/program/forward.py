r"""One encrypted forward program for every model family (:mod:`crypto.program.spec`).

Values are feature-major packed (:mod:`crypto.he.packing`: one value per feature, slot
``b n + i`` = token ``i`` of sequence ``b``) and evaluated by the level-tracking
:class:`~crypto.he.evaluator.Evaluator` on any backend (NumpyBackend or TenSEAL). Per
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
from dataclasses import dataclass

from ..he.evaluator import Evaluator, Roll, Value
from .attention import gk_attention
from .blocks import layer_norm, mapped, project, residual
from .spec import Block, Program

Lora = dict[str, list[list[Value]]]
Trace = dict[str, list[Value]]

ATTENTION_LEVELS = 5
"""Levels of the attention stage: distance (1), kernel (3), weighting (1)."""


@dataclass
class Run:
    """What one evaluation brings besides the weights and the embeddings.

    The evaluator, the client's encrypted factors, the key owner's ``roll`` or the
    client's ``rolled_z``, the optional key weights ``masks``, the optional
    ``trace`` to fill.
    """

    ev: Evaluator
    lora: Lora
    roll: Roll | None = None
    rolled_z: list[list[Value]] | None = None
    masks: list[Value] | None = None
    trace: Trace | None = None

    def keep(self, name: str, values: Sequence[Value]) -> None:
        """Record ``values`` in the trace (if any) under ``name``."""
        if self.trace is not None:
            self.trace[name] = list(values)

    def qkv(self, b: Block, z: list[Value], name: str) -> list[Value]:
        """Projection ``name`` of ``z``: public map plus the client's LoRA product."""
        lin = {"q": b.q, "k": b.k, "v": b.v}[name]
        A, B = self.lora[f"{b.prefix}{name}_a"], self.lora[f"{b.prefix}{name}_b"]
        low = self.ev.lora(z, lin.weight, A, B)
        if lin.bias is None:
            return low
        return [self.ev.shift(y, float(c)) for y, c in zip(low, lin.bias, strict=True)]


def attention(r: Run, p: Program, b: Block, z: list[Value]) -> list[Value]:
    """The block's attention output, ready for the output projection (1 level)."""
    ev, d, n, pre = r.ev, p.d, p.n_tokens, b.prefix
    zq = ev.ensure(z, 2, f"{pre}qkv")
    q = r.qkv(b, zq, "q")
    if r.rolled_z is None:
        if r.roll is None:
            raise ValueError("give roll (interactive) or rolled_z")
        rolled = r.roll(r.qkv(b, zq, "k") + r.qkv(b, zq, "v"), n)
        ev.note("roll_rounds")
        ks, vs = [c[:d] for c in rolled], [c[d:] for c in rolled]
    else:
        ks, vs = [], []
        for zs in r.rolled_z:
            zs = ev.ensure(zs, 2, f"{pre}qkv")
            ks.append(r.qkv(b, zs, "k"))
            vs.append(r.qkv(b, zs, "v"))
    if p.kv_grouping == "kind":
        flat = q + [x for c in ks for x in c] + [x for c in vs for x in c]
        flat = ev.ensure(flat, ATTENTION_LEVELS, f"{pre}attention")
        ks = [flat[d + s * d : d + (s + 1) * d] for s in range(n)]
        vs = [flat[d + n * d + s * d : d + n * d + (s + 1) * d] for s in range(n)]
    else:
        flat = q + [x for s in range(n) for x in ks[s] + vs[s]]
        flat = ev.ensure(flat, ATTENTION_LEVELS, f"{pre}attention")
        copies = [flat[d + s * 2 * d : d + (s + 1) * 2 * d] for s in range(n)]
        ks, vs = [c[:d] for c in copies], [c[d:] for c in copies]
    q = flat[:d]
    if r.masks is not None:
        vs = [[ev.mul(x, r.masks[s]) for x in c] for s, c in enumerate(vs)]
    r.keep(f"{pre}q", q)
    r.keep(f"{pre}k", [x for c in ks for x in c])
    r.keep(f"{pre}v", [x for c in vs for x in c])
    attended = gk_attention(ev, q, ks, vs, p.heads, b.gk)
    attended = ev.ensure(attended, 1, f"{pre}output projection")
    r.keep(f"{pre}attended", attended)
    return attended


def block(r: Run, p: Program, b: Block, z: list[Value]) -> list[Value]:
    """One block (:class:`~crypto.program.spec.Block`): the next block's input."""
    ev, pre = r.ev, b.prefix
    r.keep(f"{pre}input", z)
    h = residual(ev, z, project(ev, attention(r, p, b, z), b.o))
    if b.attention_norm is not None:
        h = layer_norm(ev, h, b.attention_norm)
    u = h
    if b.ffn_norm is not None:  # the residual keeps the refreshed h
        h = ev.ensure(h, 2, f"{b.ffn_norm.stage} statistics")
        u = layer_norm(ev, h, b.ffn_norm)
    r.keep(f"{pre}h", h)
    r.keep(f"{pre}normed", u)
    hidden = mapped(ev, u, b.w1, b.act, f"{pre}feed-forward")
    hidden = ev.ensure(hidden, 1, f"{pre}feed-forward output")
    r.keep(f"{pre}hidden", hidden)
    out = residual(ev, h, project(ev, hidden, b.w2))
    if b.output_norm is not None:
        out = layer_norm(ev, out, b.output_norm)
    r.keep(f"{pre}output", out)
    return out


def encode(r: Run, p: Program, z: list[Value]) -> list[Value]:
    """The pooler's output on every slot (every block, then the tanh pooler).

    ``r`` gives ``roll`` (the key owner returns rolled fresh copies of K and V) or,
    for a one-block program, ``rolled_z`` (the client uploaded rolled copies of its
    embeddings); ``masks`` are the ``n`` key-weight values of a padding mask;
    ``trace`` receives every stage's activations (module docstring).
    """
    d, n = p.d, p.n_tokens
    if (r.roll is None) == (r.rolled_z is None):
        raise ValueError("give exactly one of roll (interactive) or rolled_z")
    if len(z) != d:
        raise ValueError(f"expected {d} feature values, got {len(z)}")
    if r.masks is not None and len(r.masks) != n:
        raise ValueError(f"expected {n} key-weight values, got {len(r.masks)}")
    if r.rolled_z is not None:
        if len(p.blocks) != 1:
            raise ValueError(
                f"rolled_z serves a one-block program; this one has {len(p.blocks)}"
            )
        if len(r.rolled_z) != n:
            raise ValueError(f"expected {n} rolled copies, got {len(r.rolled_z)}")
    for b in p.blocks:
        z = block(r, p, b, z)
    h = p.head
    pooled = mapped(r.ev, z, h.pool, h.tanh, h.stage, r.lora.get("pool"))
    r.keep("pooled", pooled)
    return pooled


def forward(r: Run, p: Program, z: list[Value]) -> list[Value]:
    """Logits on every slot (the CLS slots are the answer); ``r`` as in :func:`encode`.

    The classifier is public (``p.head.classifier``) or the client's encrypted
    ``lora["classifier"]``.
    """
    pooled = r.ev.ensure(encode(r, p, z), 1, "classifier")
    logits = project(r.ev, pooled, p.head.classifier, r.lora.get("classifier"))
    r.keep("logits", logits)
    return logits
