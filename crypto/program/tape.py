r"""The forward pass of a fine-tuning step, filling the trace its backward pass reads.

The same program as :mod:`crypto.program.forward` (a :class:`~.spec.Program` of
either family, the client's encrypted values in ``Run.lora``) with the refresh
policy of training: every stage *fits* its operands (:func:`fit` refreshes only
the values that would overrun the chain, in one counted round trip), and the
stages that the backward pass differentiates keep their intermediates in
``Run.trace`` under ``f"{prefix}{site}"``. Which matrices are the client's
encrypted ones is read from ``Run.lora``: LoRA factors ``f"{prefix}q_a"`` ...,
full matrices ``f"{prefix}wq"`` ... ``f"{prefix}w2"`` (HEFormer's ``full`` arm),
the head's ``"pool"`` and ``"classifier"``. Per trained block, with
:math:`x' = z W_x + b_x + (z A_x) B_x`:

.. math::

    h = N_a(z + \mathrm{att}(q', k'_s, M_s v'_s) W_o + b_o), \quad
    o = N_o(h + p(N_f(h) W_1 + b_1) W_2 + b_2),

and the head :math:`\ell = p_{\tanh}(o W_p + b_p) W_c + b_c` (Rho et al., 2025,
Sec. 4.2). Attention is the Gaussian kernel or, for the HEFormer's baseline arm,
the polynomial softmax (:mod:`crypto.program.attention`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Value
from .attention import SoftmaxPolys
from .forward import Run
from .spec import Block, Norm, Program, depth

Matrix = FloatArray | list[list[Value]]
"""A public array, or the client's encrypted matrix (one value per entry)."""
QKV = tuple[list[Value], list[list[Value]], list[list[Value]]]
"""Queries, and the keys and values of each shift (rolled copies)."""

TANH_STAGE = {"heformer": "pooler", "bert": "tanh"}
"""The name of the pre-tanh refresh in each family's public schedule."""


def derivative(coefficients: FloatArray) -> FloatArray:
    """Coefficients (low to high) of the derivative polynomial."""
    c = np.asarray(coefficients, dtype=np.float64)
    if c.size < 2:
        raise ValueError("a polynomial of degree >= 1 is needed")
    out: FloatArray = c[1:] * np.arange(1, c.size)
    return out


def fit(
    ev: Evaluator, groups: Sequence[Sequence[Value]], need: int, stage: str
) -> list[list[Value]]:
    """Refresh (in one counted round trip) the values that lack ``need`` levels."""
    flat = [v for g in groups for v in g]
    stale = [i for i, v in enumerate(flat) if v.level + need > ev.max_level]
    if stale:
        fresh = ev.ensure([flat[i] for i in stale], need, stage)
        for i, v in zip(stale, fresh, strict=True):
            flat[i] = v
    out, at = [], 0
    for g in groups:
        out.append(flat[at : at + len(g)])
        at += len(g)
    return out


def matmul(ev: Evaluator, xs: Sequence[Value], W: Matrix) -> list[Value]:
    r""":math:`y_f = \sum_g x_g W_{gf}`: plaintext products or encrypted ones.

    A public all-zero column gives a zero value (``x_0`` times 0).
    """
    if isinstance(W, np.ndarray):
        zero = ~W.any(axis=0)
        if not zero.any():
            return ev.linear(xs, W)
        out = [ev.scale(xs[0], 0.0)] * W.shape[1]
        live = np.flatnonzero(~zero)
        if live.size:
            for f, y in zip(live, ev.linear(xs, W[:, live]), strict=True):
                out[f] = y
        return out
    if len(W) != len(xs):
        raise ValueError(f"matmul: {len(xs)} inputs for {len(W)} weight rows")
    return [
        ev.total([ev.mul(xs[g], W[g][f]) for g in range(len(xs))])
        for f in range(len(W[0]))
    ]


def matmul_t(ev: Evaluator, dys: Sequence[Value], W: Matrix) -> list[Value]:
    r""":math:`\bar x_g = \sum_f \bar y_f W_{gf}` (the transpose product)."""
    if isinstance(W, np.ndarray):
        return matmul(ev, dys, W.T)
    return [
        ev.total([ev.mul(dys[f], W[g][f]) for f in range(len(dys))])
        for g in range(len(W))
    ]


def outer_sums(
    ev: Evaluator, xs: Sequence[Value], dys: Sequence[Value]
) -> list[list[Value]]:
    r""":math:`G_{gf} = \sum_t x_g[t]\, \bar y_f[t]` (one product and slot sum each)."""
    return [[ev.slot_sum(ev.mul(x, dy)) for dy in dys] for x in xs]


def weight(r: Run, b: Block, name: str) -> Matrix:
    """Block matrix ``name`` (``q k v o w1 w2``): the client's, else the public one."""
    key = f"{b.prefix}{name if name[0] == 'w' else 'w' + name}"
    secret = r.lora.get(key)
    if secret is not None:
        return secret
    lin = getattr(b, name)
    return np.asarray(lin.weight)


def dense(
    r: Run, xs: Sequence[Value], W: Matrix, bias: FloatArray | None
) -> list[Value]:
    """``xs W + b`` (public or encrypted W; ``b`` None adds nothing)."""
    ys = matmul(r.ev, xs, W)
    if bias is None:
        return ys
    return [r.ev.shift(y, float(c)) for y, c in zip(ys, bias, strict=True)]


def heads(p: Program) -> list[list[int]]:
    """The feature columns of each attention head."""
    dh = p.d // p.heads
    return [list(range(h * dh, (h + 1) * dh)) for h in range(p.heads)]


def gk_forward(r: Run, p: Program, b: Block, qkv: QKV) -> list[Value]:
    """Gaussian-kernel attention; keeps per head its differences, distances, weights."""
    q, ks, vs = qkv
    ev, pre, n = r.ev, b.prefix, len(ks)
    q, *ks = fit(ev, [q, *ks], 1, "kernel distance")
    out: list[Value] = [Value(None)] * p.d
    for h, cols in enumerate(heads(p)):
        diff = [[ev.sub(q[f], ks[s][f]) for f in cols] for s in range(n)]
        [u] = fit(
            ev,
            [[ev.total([ev.square(x) for x in diff[s]]) for s in range(n)]],
            3,
            "kernel",
        )
        w = [ev.poly(x, b.gk) for x in u]
        w, *vh = fit(ev, [w, *[[vs[s][f] for f in cols] for s in range(n)]], 1, "kv")
        for i, f in enumerate(cols):
            out[f] = ev.total([ev.mul(w[s], vh[s][i]) for s in range(n)])
        tag = f"{pre}head {h} "
        for s in range(n):
            r.keep(f"{tag}diff {s}", diff[s])
            r.keep(f"{tag}v {s}", vh[s])
        r.keep(f"{tag}u", u)
        r.keep(f"{tag}w", w)
    return out


def softmax_forward(
    r: Run, p: Program, b: Block, qkv: QKV, polys: SoftmaxPolys
) -> list[Value]:
    """Polynomial-softmax attention; keeps per head what its backward pass reads."""
    q, ks, vs = qkv
    ev, pre, n = r.ev, b.prefix, len(ks)
    out: list[Value] = [Value(None)] * p.d
    for h, cols in enumerate(heads(p)):
        groups = [[q[f] for f in cols], *[[k[f] for f in cols] for k in ks]]
        qh, *kh = fit(ev, groups, 1, "softmax scores")
        dots = [
            ev.total([ev.mul(a, c) for a, c in zip(qh, kh[s], strict=True)])
            for s in range(n)
        ]
        [scores] = fit(ev, [dots], 3, "softmax exp")
        e = [ev.poly(x, polys.exp) for x in scores]
        [[total]] = fit(ev, [[ev.total(e)]], 2, "softmax reciprocal")
        y = ev.poly(total, polys.recip)
        for _ in range(polys.newton):
            [[total, y]] = fit(ev, [[total, y]], 2, "softmax Newton")
            y = ev.mul(y, ev.shift(ev.neg(ev.mul(total, y)), 2.0))
        e, *vh = fit(ev, [e, *[[vs[s][f] for f in cols] for s in range(n)]], 1, "kv")
        acc = [
            ev.total([ev.mul(e[s], vh[s][i]) for s in range(n)])
            for i in range(len(cols))
        ]
        acc, [y] = fit(ev, [acc, [y]], 1, "softmax normalise")
        for i, f in enumerate(cols):
            out[f] = ev.mul(acc[i], y)
        tag = f"{pre}head {h} "
        for name, values in (("q", qh), ("scores", scores), ("e", e), ("y", [y])):
            r.keep(f"{tag}{name}", values)
        r.keep(f"{tag}acc", acc)
        for s in range(n):
            r.keep(f"{tag}k {s}", kh[s])
            r.keep(f"{tag}v {s}", vh[s])
    return out


def norm_forward(r: Run, x: list[Value], w: Norm) -> tuple[list[Value], list[Value]]:
    r"""(LayerNorm of ``x``, ``x`` as refreshed): :func:`~.blocks.layer_norm` fitted.

    Keeps (under ``w.stage``) :math:`\hat x = xO` as scaled, the centred
    :math:`xS`, :math:`\sigma`, each Newton step's fitted :math:`\sigma` and
    :math:`y_0, \ldots, y_K`.
    """
    ev, st = r.ev, w.stage
    [x] = fit(ev, [x], 2, f"{st} statistics")
    centred = ev.linear(x, w.stats)
    scaled = centred if w.out is None else ev.linear(x, w.out)
    sigma = ev.total([ev.square(c) for c in centred])
    [[sigma]] = fit(ev, [[sigma]], depth(w.isqrt), f"{st} inverse sqrt")
    ys = [ev.poly(sigma, w.isqrt)]
    for k in range(w.newton):
        [[s, y]] = fit(ev, [[sigma, ys[-1]]], 3, f"{st} Newton")
        ys[-1] = y
        r.keep(f"{st} sigma {k}", [s])
        ys.append(ev.mul(y, ev.shift(ev.neg(ev.mul(s, ev.square(y))), w.newton_shift)))
    scaled, [y] = fit(ev, [scaled, [ys[-1]]], 1, f"{st} scale")
    out = [ev.mul(s, y) for s in scaled]
    if w.beta is not None:
        out = [ev.shift(o, float(c)) for o, c in zip(out, w.beta, strict=True)]
    r.keep(f"{st} scaled", scaled)
    r.keep(f"{st} centred", scaled if w.out is None else centred)
    r.keep(f"{st} sigma", [sigma])
    r.keep(f"{st} ys", ys)
    r.keep(f"{st} y", [y])
    return out, x


def projections(r: Run, b: Block, z: list[Value]) -> dict[str, list[Value]]:
    """Q, K, V of ``z``: public or encrypted matrix, the LoRA product, the bias."""
    ev, out = r.ev, {}
    for name in "qkv":
        base = matmul(ev, z, weight(r, b, name))
        A = r.lora.get(f"{b.prefix}{name}_a")
        if A is not None:
            low = matmul(ev, z, A)
            r.keep(f"{b.prefix}{name} low", low)
            up = matmul(ev, low, r.lora[f"{b.prefix}{name}_b"])
            base = [ev.add(x, u) for x, u in zip(base, up, strict=True)]
        bias = getattr(b, name).bias
        if bias is not None:
            base = [ev.shift(x, float(c)) for x, c in zip(base, bias, strict=True)]
        out[name] = base
    return out


def block(
    r: Run, p: Program, b: Block, z: list[Value], softmax: SoftmaxPolys | None = None
) -> list[Value]:
    """One block's training forward pass (module docstring): the next block's input."""
    ev, pre, d, n = r.ev, b.prefix, p.d, p.n_tokens
    if r.roll is None:
        raise ValueError("a training step needs the key owner's roll (interactive)")
    [z] = fit(ev, [z], 2, f"{pre}qkv")
    r.keep(f"{pre}input", z)
    proj = projections(r, b, z)
    rolled = r.roll(proj["k"] + proj["v"], n)
    ev.note("roll_rounds")
    ks, vs = [c[:d] for c in rolled], [c[d:] for c in rolled]
    if r.masks is not None:
        for s in range(n):
            vals, [mk] = fit(ev, [vs[s], [r.masks[s]]], 1, f"{pre}key weights")
            vs[s] = [ev.mul(x, mk) for x in vals]
    if softmax is None:
        att = gk_forward(r, p, b, (proj["q"], ks, vs))
    else:
        att = softmax_forward(r, p, b, (proj["q"], ks, vs), softmax)
    [att] = fit(ev, [att], 1, f"{pre}output projection")
    r.keep(f"{pre}attended", att)
    projected = dense(r, att, weight(r, b, "o"), b.o.bias)
    h = [ev.add(x, y) for x, y in zip(z, projected, strict=True)]
    if b.attention_norm is not None:
        h, _ = norm_forward(r, h, b.attention_norm)
    u = h
    if b.ffn_norm is not None:  # the residual keeps the refreshed h
        u, h = norm_forward(r, h, b.ffn_norm)
        [u] = fit(ev, [u], 1, f"{pre}feed-forward")
    else:
        [h] = fit(ev, [h], 1, f"{pre}feed-forward")
        u = h
    r.keep(f"{pre}normed", u)
    pre_act = dense(r, u, weight(r, b, "w1"), b.w1.bias)
    [a] = fit(ev, [pre_act], depth(b.act), f"{pre}activation")
    r.keep(f"{pre}pre-activation", a)
    [hid] = fit(ev, [[ev.poly(x, b.act) for x in a]], 1, f"{pre}feed-forward out")
    r.keep(f"{pre}hidden", hid)
    out = dense(r, hid, weight(r, b, "w2"), b.w2.bias)
    o = [ev.add(x, y) for x, y in zip(h, out, strict=True)]
    if b.output_norm is not None:
        o, _ = norm_forward(r, o, b.output_norm)
    return o


def head(r: Run, p: Program, z: list[Value]) -> list[Value]:
    """Logits on every slot from the last block's output (public or secret head)."""
    ev, hd = r.ev, p.head
    [z] = fit(ev, [z], 1, hd.stage)
    r.keep("head input", z)
    pool = r.lora.get("pool", np.asarray(hd.pool.weight))
    [t] = fit(
        ev,
        [dense(r, z, pool, hd.pool.bias)],
        depth(hd.tanh),
        TANH_STAGE.get(p.family, "tanh"),
    )
    r.keep("pre-tanh", t)
    [pooled] = fit(ev, [[ev.poly(x, hd.tanh) for x in t]], 1, "classifier")
    r.keep("pooled", pooled)
    classifier = r.lora.get("classifier", np.asarray(hd.classifier.weight))
    return dense(r, pooled, classifier, hd.classifier.bias)
