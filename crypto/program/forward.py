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
function of the spec, the run's refresh policy (:class:`~crypto.program.run.Policy`:
:data:`~crypto.program.run.INFERENCE` fuses the attention's levels into one
``"attention"`` group, :data:`~crypto.program.run.TRAINING` fits every stage) and
the chain, which is what lets the client derive the public schedules on zeros.
``trace`` (optional) receives the activations the backward pass
(:mod:`crypto.program.backward`) reads, named ``f"{prefix}{site}"``. Besides the
LoRA factors, ``Run.lora`` may hold a block's full matrices ``f"{prefix}wq"`` ...
``f"{prefix}w2"`` (HEFormer's ``full`` arm) and the head's ``"pool"`` and
``"classifier"``; ``softmax`` selects the polynomial softmax (the HEFormer's
baseline arm) instead of the Gaussian kernel.
"""

from __future__ import annotations

from ..he.evaluator import Value
from .attention import SoftmaxPolys, gk_stage, softmax_stage
from .blocks import dense, norm, polymap, residual, weight
from .run import INFERENCE, TRAINING, Lora, Policy, Run, Trace
from .spec import Block, Program

__all__ = [
    "ATTENTION_LEVELS",
    "INFERENCE",
    "TRAINING",
    "Lora",
    "Policy",
    "Run",
    "Trace",
    "attention",
    "block",
    "encode",
    "forward",
    "logits",
    "pooler",
]

ATTENTION_LEVELS = 5
"""Levels of the fused attention group: distance (1), kernel (3), weighting (1)."""


def projections(r: Run, b: Block, z: list[Value], names: str) -> list[list[Value]]:
    """``names`` of Q, K, V of ``z``: public or encrypted matrix, LoRA product, bias."""
    ev, out = r.ev, []
    for name in names:
        base = dense(ev, z, weight(r, b, name), None)
        A = r.lora.get(f"{b.prefix}{name}_a")
        if A is not None:
            low = dense(ev, z, A, None)
            r.keep(f"{b.prefix}{name} low", low)
            up = dense(ev, low, r.lora[f"{b.prefix}{name}_b"], None)
            base = residual(ev, base, up)
        bias = getattr(b, name).bias
        if bias is not None:
            base = [ev.shift(x, float(c)) for x, c in zip(base, bias, strict=True)]
        out.append(base)
    return out


def _grouped(
    r: Run,
    p: Program,
    b: Block,
    q: list[Value],
    ks: list[list[Value]],
    vs: list[list[Value]],
) -> tuple[list[Value], list[list[Value]], list[list[Value]]]:
    """The fused policy's one ``"attention"`` group, in the program's order."""
    d, n = p.d, p.n_tokens
    if p.kv_grouping == "kind":
        flat = q + [x for c in ks for x in c] + [x for c in vs for x in c]
        [flat] = r.fit([flat], ATTENTION_LEVELS, f"{b.prefix}attention")
        ks = [flat[d + s * d : d + (s + 1) * d] for s in range(n)]
        vs = [flat[d + n * d + s * d : d + n * d + (s + 1) * d] for s in range(n)]
    else:
        flat = q + [x for s in range(n) for x in ks[s] + vs[s]]
        [flat] = r.fit([flat], ATTENTION_LEVELS, f"{b.prefix}attention")
        copies = [flat[d + s * 2 * d : d + (s + 1) * 2 * d] for s in range(n)]
        ks, vs = [c[:d] for c in copies], [c[d:] for c in copies]
    return flat[:d], ks, vs


def _attend(
    r: Run, p: Program, b: Block, z: list[Value], softmax: SoftmaxPolys | None
) -> tuple[list[Value], list[Value]]:
    """(``z`` as refreshed for the projections, the attention ready for ``W_o``)."""
    ev, d, n, pre = r.ev, p.d, p.n_tokens, b.prefix
    [z] = r.fit([z], 2, f"{pre}qkv")
    r.keep(f"{pre}input", z)
    if r.rolled_z is None:
        if r.roll is None:
            raise ValueError("give roll (interactive) or rolled_z")
        q, k, v = projections(r, b, z, "qkv")
        rolled = r.roll(k + v, n)
        ev.note("roll_rounds")
        ks, vs = [c[:d] for c in rolled], [c[d:] for c in rolled]
    else:
        [q] = projections(r, b, z, "q")
        ks, vs = [], []
        for zs in r.rolled_z:
            [zs] = r.fit([zs], 2, f"{pre}qkv")
            k, v = projections(r, b, zs, "kv")
            ks.append(k)
            vs.append(v)
    if r.policy.fused:
        q, ks, vs = _grouped(r, p, b, q, ks, vs)
    if r.masks is not None:
        for s in range(n):
            vals, [mk] = r.fit([vs[s], [r.masks[s]]], 1, f"{pre}key weights")
            vs[s] = [ev.mul(x, mk) for x in vals]
    if softmax is None:
        att = gk_stage(r, p.heads, (q, ks, vs), b.gk, pre)
    else:
        att = softmax_stage(r, p.heads, (q, ks, vs), softmax, pre)
    [att] = r.fit([att], 1, f"{pre}output projection")
    r.keep(f"{pre}attended", att)
    return z, att


def attention(r: Run, p: Program, b: Block, z: list[Value]) -> list[Value]:
    """The block's attention output, ready for the output projection."""
    return _attend(r, p, b, z, None)[1]


def block(
    r: Run, p: Program, b: Block, z: list[Value], softmax: SoftmaxPolys | None = None
) -> list[Value]:
    """One block (:class:`~crypto.program.spec.Block`): the next block's input."""
    ev, pre, pol = r.ev, b.prefix, r.policy
    zq, att = _attend(r, p, b, z, softmax)
    h = residual(
        ev,
        zq if pol.residual_refreshed else z,
        dense(ev, att, weight(r, b, "o"), b.o.bias),
    )
    if b.attention_norm is not None:
        h, _ = norm(r, h, b.attention_norm)
    u = h
    if b.ffn_norm is not None:  # the residual keeps the refreshed h
        u, h = norm(r, h, b.ffn_norm)
    stages = (f"{pre}feed-forward", pol.stage(pol.activation, p, pre))
    u, a, hidden = polymap(r, u, (weight(r, b, "w1"), b.w1.bias), b.act, stages)
    if b.ffn_norm is None and pol.residual_refreshed:
        h = u
    r.keep(f"{pre}normed", u)
    r.keep(f"{pre}pre-activation", a)
    [hidden] = r.fit([hidden], 1, pol.stage(pol.hidden, p, pre))
    r.keep(f"{pre}hidden", hidden)
    out = residual(ev, h, dense(ev, hidden, weight(r, b, "w2"), b.w2.bias))
    if b.output_norm is not None:
        out, _ = norm(r, out, b.output_norm)
    return out


def _check(r: Run, p: Program, z: list[Value]) -> None:
    """Clear errors for inputs off the program's layout."""
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


def pooler(r: Run, p: Program, z: list[Value]) -> list[Value]:
    r"""The tanh pooler :math:`p_{\tanh}(z W_p + b_p)` on every slot (any head)."""
    hd, pol = p.head, r.policy
    W = r.lora.get("pool", hd.pool.weight)
    stages = (hd.stage, pol.stage(pol.tanh, p))
    z, t, pooled = polymap(r, z, (W, hd.pool.bias), hd.tanh, stages)
    r.keep("head input", z)
    r.keep("pre-tanh", t)
    return pooled


def logits(r: Run, p: Program, pooled: list[Value]) -> list[Value]:
    """The classifier on the pooler's output (public or the client's)."""
    hd = p.head
    [pooled] = r.fit([pooled], 1, "classifier")
    r.keep("pooled", pooled)
    W = r.lora.get("classifier", hd.classifier.weight)
    out = dense(r.ev, pooled, W, hd.classifier.bias)
    r.keep("logits", out)
    return out


def encode(r: Run, p: Program, z: list[Value]) -> list[Value]:
    """The pooler's output on every slot (every block, then the tanh pooler).

    ``r`` gives ``roll`` (the key owner returns rolled fresh copies of K and V) or,
    for a one-block program, ``rolled_z`` (the client uploaded rolled copies of its
    embeddings); ``masks`` are the ``n`` key-weight values of a padding mask;
    ``trace`` receives the activations (module docstring).
    """
    _check(r, p, z)
    for b in p.blocks:
        z = block(r, p, b, z)
    return pooler(r, p, z)


def forward(
    r: Run,
    p: Program,
    z: list[Value],
    trained: int = 0,
    softmax: SoftmaxPolys | None = None,
) -> list[Value]:
    """Logits on every slot (the CLS slots are the answer); ``r`` as in :func:`encode`.

    ``trained`` > 0 is a fine-tuning step's forward pass: the blocks before the last
    ``trained`` run under the inference policy without a trace, the last ones and
    the head under :data:`~crypto.program.run.TRAINING` (with ``softmax``, if given,
    as their attention), filling ``r.trace``. The classifier is public
    (``p.head.classifier``) or the client's encrypted ``lora["classifier"]``.
    """
    if not trained:
        return logits(r, p, encode(r, p, z))
    _check(r, p, z)
    first, policy = len(p.blocks) - trained, r.policy
    keep, r.trace, r.policy = r.trace, None, INFERENCE
    for b in p.blocks[:first]:
        z = block(r, p, b, z)
    r.trace, r.policy = keep, TRAINING
    for b in p.blocks[first:]:
        z = block(r, p, b, z, softmax)
    try:
        return logits(r, p, pooler(r, p, z))
    finally:
        r.policy = policy
