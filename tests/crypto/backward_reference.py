"""The backward passes before issue 41's unification, kept verbatim as the reference.

:mod:`tests.crypto.test_backward` asks :mod:`crypto.program.backward` for the same
gradients bit for bit, the same operation counts and the same public schedule as
these (the HEFormer's ``backprop``/``attention_grad``/``net`` primitives and the
converted BERT's ``bert_lora`` and ``bert_tuning.head_gradients``, as they stood at
commit 9770ea3, imports adjusted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from defense_suite.crypto.he.evaluator import Evaluator, Roll, Value
from defense_suite.crypto.program.encoder import (
    LORA,
    BertWeights,
    BlockWeights,
    NormWeights,
    _attention,
    _mapped,
    affine,
    depth,
    layer_norm,
)
from defense_suite.crypto.program.net import Matrix, Net
from defenses.arrays import FloatArray


def derivative(coefficients: FloatArray) -> FloatArray:
    """Coefficients (low to high) of the derivative polynomial."""
    c = np.asarray(coefficients, dtype=np.float64)
    if c.size < 2:
        raise ValueError("a polynomial of degree >= 1 is needed")
    out: FloatArray = c[1:] * np.arange(1, c.size)
    return out


def matmul(ev: Evaluator, xs: list[Value], W: Matrix) -> list[Value]:
    r""":math:`y_f = \sum_g x_g W_{gf}`: plaintext products or encrypted ones."""
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


def matmul_t(ev: Evaluator, dys: list[Value], W: Matrix) -> list[Value]:
    r""":math:`\bar x_g = \sum_f \bar y_f W_{gf}` (the transpose product)."""
    if isinstance(W, np.ndarray):
        return matmul(ev, dys, W.T)
    return [
        ev.total([ev.mul(dys[f], W[g][f]) for f in range(len(dys))])
        for g in range(len(W))
    ]


def outer_sums(ev: Evaluator, xs: list[Value], dys: list[Value]) -> list[list[Value]]:
    r""":math:`G_{gf} = \sum_t x_g[t]\, \bar y_f[t]` (one product and slot sum each)."""
    return [[ev.slot_sum(ev.mul(x, dy)) for dy in dys] for x in xs]


def fit(
    ev: Evaluator, groups: list[list[Value]], need: int, stage: str
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


def heads_of(net: Net, d: int) -> list[list[int]]:
    """The feature columns of each attention head."""
    dh = d // net.heads
    return [list(range(h * dh, (h + 1) * dh)) for h in range(net.heads)]


def gk_forward(
    ev: Evaluator,
    net: Net,
    q: list[Value],
    ks: list[list[Value]],
    vs: list[list[Value]],
    cache: dict[str, Any],
) -> list[Value]:
    """Gaussian-kernel attention on rolled copies; caches what its backward reads."""
    d, n = len(q), len(ks)
    q, *ks = fit(ev, [q, *ks], 1, "kernel distance")
    out: list[Value] = [Value(None)] * d
    per_head = []
    for cols in heads_of(net, d):
        diff = [[ev.sub(q[f], ks[s][f]) for f in cols] for s in range(n)]
        [u] = fit(
            ev,
            [[ev.total([ev.square(x) for x in diff[s]]) for s in range(n)]],
            3,
            "kernel",
        )
        w = [ev.poly(x, net.gk) for x in u]
        w, *vh = fit(ev, [w, *[[vs[s][f] for f in cols] for s in range(n)]], 1, "kv")
        for i, f in enumerate(cols):
            out[f] = ev.total([ev.mul(w[s], vh[s][i]) for s in range(n)])
        per_head.append({"diff": diff, "u": u, "w": w, "v": vh})
    cache["attention"] = per_head
    return out


def gk_backward(
    ev: Evaluator, net: Net, datt: list[Value], cache: dict[str, Any]
) -> tuple[list[Value], list[list[Value]], list[list[Value]]]:
    """Gradients of the queries and of each shift's keys and values (kernel)."""
    d = len(datt)
    per_head = cache["attention"]
    n = len(per_head[0]["u"])
    dq: list[Value] = [Value(None)] * d
    dks = [[Value(None)] * d for _ in range(n)]
    dvs = [[Value(None)] * d for _ in range(n)]
    gk_d = derivative(net.gk)
    for cols, saved in zip(heads_of(net, d), per_head, strict=True):
        dcol = [datt[f] for f in cols]
        dcol, *vh = fit(ev, [dcol, *saved["v"]], 1, "kernel grad")
        g = [
            ev.total([ev.mul(dcol[i], vh[s][i]) for i in range(len(cols))])
            for s in range(n)
        ]
        dcol, w = fit(ev, [dcol, saved["w"]], 1, "value grad")
        for s in range(n):
            for i, f in enumerate(cols):
                dvs[s][f] = ev.mul(dcol[i], w[s])
        [u] = fit(ev, [saved["u"]], 3, "kernel derivative")
        slope = [ev.poly(x, gk_d) for x in u]
        g, slope = fit(ev, [g, slope], 1, "distance grad")
        du = [ev.mul(a, b) for a, b in zip(g, slope, strict=True)]
        for s in range(n):
            [dus], diff = fit(ev, [[du[s]], saved["diff"][s]], 1, "difference grad")
            for i, f in enumerate(cols):
                half = ev.mul(dus, diff[i])
                ddiff = ev.add(half, half)
                dks[s][f] = ev.neg(ddiff)
                dq[f] = ddiff if s == 0 else ev.add(dq[f], ddiff)
    return dq, dks, dvs


def softmax_forward(
    ev: Evaluator,
    net: Net,
    q: list[Value],
    ks: list[list[Value]],
    vs: list[list[Value]],
    cache: dict[str, Any],
) -> list[Value]:
    """Polynomial-softmax attention on rolled copies; caches its intermediates."""
    assert net.softmax is not None
    polys = net.softmax
    d, n = len(q), len(ks)
    out: list[Value] = [Value(None)] * d
    per_head = []
    for cols in heads_of(net, d):
        qh, *kh = fit(
            ev,
            [[q[f] for f in cols], *[[k[f] for f in cols] for k in ks]],
            1,
            "softmax scores",
        )
        [scores] = fit(
            ev,
            [
                [
                    ev.total([ev.mul(a, b) for a, b in zip(qh, kh[s], strict=True)])
                    for s in range(n)
                ]
            ],
            3,
            "softmax exp",
        )
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
        per_head.append(
            {"q": qh, "k": kh, "v": vh, "scores": scores, "e": e, "y": y, "acc": acc}
        )
    cache["attention"] = per_head
    return out


def softmax_backward(
    ev: Evaluator, net: Net, datt: list[Value], cache: dict[str, Any]
) -> tuple[list[Value], list[list[Value]], list[list[Value]]]:
    """Gradients of the queries and of each shift's keys and values (softmax)."""
    assert net.softmax is not None
    d = len(datt)
    per_head = cache["attention"]
    n = len(per_head[0]["scores"])
    dq: list[Value] = [Value(None)] * d
    dks = [[Value(None)] * d for _ in range(n)]
    dvs = [[Value(None)] * d for _ in range(n)]
    exp_d = derivative(net.softmax.exp)
    for cols, sv in zip(heads_of(net, d), per_head, strict=True):
        dcol = [datt[f] for f in cols]
        dcol, [y] = fit(ev, [dcol, [sv["y"]]], 1, "softmax grad")
        dacc = [ev.mul(x, y) for x in dcol]
        dcol, acc = fit(ev, [dcol, sv["acc"]], 1, "softmax grad")
        dy = ev.total([ev.mul(a, b) for a, b in zip(dcol, acc, strict=True)])
        [[y]] = fit(ev, [[sv["y"]]], 1, "softmax grad")
        [[dy, ysq]] = fit(ev, [[dy, ev.square(y)]], 1, "softmax grad")
        dtotal = ev.neg(ev.mul(dy, ysq))
        dacc, *vh = fit(ev, [dacc, *sv["v"]], 1, "softmax value")
        de = [
            ev.total([ev.mul(dacc[i], vh[s][i]) for i in range(len(cols))])
            for s in range(n)
        ]
        de = [ev.add(x, dtotal) for x in de]
        [scores] = fit(ev, [sv["scores"]], 3, "exp derivative")
        slope = [ev.poly(x, exp_d) for x in scores]
        de, slope = fit(ev, [de, slope], 1, "score grad")
        dsc = [ev.mul(a, b) for a, b in zip(de, slope, strict=True)]
        dsc, *kh = fit(ev, [dsc, *sv["k"]], 1, "query grad")
        for i, f in enumerate(cols):
            dq[f] = ev.total([ev.mul(dsc[s], kh[s][i]) for s in range(n)])
        dsc, qh = fit(ev, [dsc, sv["q"]], 1, "key grad")
        dacc, e = fit(ev, [dacc, sv["e"]], 1, "value grad")
        for s in range(n):
            for i, f in enumerate(cols):
                dks[s][f] = ev.mul(dsc[s], qh[i])
                dvs[s][f] = ev.mul(dacc[i], e[s])
    return dq, dks, dvs


Unroll = Callable[[list[list[Value]]], list[Value]]


def _project(
    ev: Evaluator, net: Net, z: list[Value], name: str, cache: dict[str, Any]
) -> list[Value]:
    out = matmul(ev, z, net.mats[f"w{name}"])
    if net.lora:
        low = matmul(ev, z, net.mats[f"{name}_a"])
        cache[f"{name}_low"] = low
        up = matmul(ev, low, net.mats[f"{name}_b"])
        out = [ev.add(a, b) for a, b in zip(out, up, strict=True)]
    return out


def forward(
    ev: Evaluator, net: Net, z: list[Value], roll: Roll
) -> tuple[list[Value], dict[str, Any]]:
    """Logits on every slot and the cache the backward pass needs."""
    d, n = len(z), net.n_tokens
    cache: dict[str, Any] = {}
    [z] = fit(ev, [z], 2, "qkv")
    cache["z"] = z
    q = _project(ev, net, z, "q", cache)
    k = _project(ev, net, z, "k", cache)
    v = _project(ev, net, z, "v", cache)
    rolled = roll(k + v, n)
    ev.note("roll_rounds")
    ks, vs = [r[:d] for r in rolled], [r[d:] for r in rolled]
    if net.attention == "gk":
        att = gk_forward(ev, net, q, ks, vs, cache)
    else:
        att = softmax_forward(ev, net, q, ks, vs, cache)
    [att] = fit(ev, [att], 1, "output projection")
    h = [ev.add(a, b) for a, b in zip(z, matmul(ev, att, net.mats["wo"]), strict=True)]
    [h] = fit(ev, [h], 2, "LayerNorm statistics")
    c = ev.linear(h, net.centre)
    s = ev.total([ev.square(x) for x in c])
    [[s]] = fit(ev, [[s]], 2, "LayerNorm inverse sqrt")
    y0 = ev.poly(s, net.isqrt)
    [[s, y0]] = fit(ev, [[s, y0]], 3, "LayerNorm Newton")
    y = ev.mul(y0, ev.shift(ev.neg(ev.mul(s, ev.square(y0))), 3.0))
    c, [y] = fit(ev, [c, [y]], 1, "LayerNorm scale")
    u = [ev.mul(x, y) for x in c]
    [u] = fit(ev, [u], 1, "feed-forward")
    [a] = fit(ev, [matmul(ev, u, net.mats["w1"])], 2, "activation")
    [hid] = fit(ev, [[ev.poly(x, net.act) for x in a]], 1, "feed-forward out")
    o = [ev.add(x, f) for x, f in zip(h, matmul(ev, hid, net.mats["w2"]), strict=True)]
    [o] = fit(ev, [o], 1, "head")
    [t] = fit(ev, [matmul(ev, o, net.mats["pool"])], 2, "pooler")
    [pooled] = fit(ev, [[ev.poly(x, net.tanh) for x in t]], 1, "classifier")
    logits = matmul(ev, pooled, net.mats["classifier"])
    cache.update(
        att=att, h=h, c=c, s=s, y0=y0, y=y, u=u, a=a, hid=hid, o=o, t=t, pooled=pooled
    )
    return logits, cache


def backward(
    ev: Evaluator,
    net: Net,
    cache: dict[str, Any],
    dlogits: list[Value],
    unroll: Unroll,
) -> dict[str, list[list[Value]]]:
    """Encrypted gradient sums of every trained matrix (replicated over the slots)."""
    grads: dict[str, list[list[Value]]] = {}
    m = net.mats

    def dense(name: str, inputs: list[Value], dout: list[Value]) -> list[Value]:
        """Back through ``inputs @ W[name]``; record W's gradient sums if trained."""
        x, dout = fit(ev, [inputs, dout], 1, f"{name} grad")
        if name in net.trained:
            grads[name] = outer_sums(ev, x, dout)
        return matmul_t(ev, dout, m[name])

    def elementwise(
        pre: list[Value], poly: FloatArray, dout: list[Value], need: int, stage: str
    ) -> list[Value]:
        """Back through ``poly`` applied to ``pre`` (the chain rule, slot-wise)."""
        [pre] = fit(ev, [pre], need, f"{stage} derivative")
        slope = [ev.poly(x, derivative(poly)) for x in pre]
        dout, slope = fit(ev, [dout, slope], 1, f"{stage} grad")
        return [ev.mul(a, b) for a, b in zip(dout, slope, strict=True)]

    dpooled = dense("classifier", cache["pooled"], dlogits)
    dt = elementwise(cache["t"], net.tanh, dpooled, 2, "tanh")
    do = dense("pool", cache["o"], dt)
    dhid = dense("w2", cache["hid"], do)
    da = elementwise(cache["a"], net.act, dhid, 1, "activation")
    du = dense("w1", cache["u"], da)
    # LayerNorm: u = c * y, y = Y(s), s = sum c^2.
    du, c, [y] = fit(ev, [du, cache["c"], [cache["y"]]], 1, "LayerNorm grad")
    dc = [ev.mul(x, y) for x in du]
    dy = ev.total([ev.mul(x, cf) for x, cf in zip(du, c, strict=True)])
    [[s, y0]] = fit(ev, [[cache["s"], cache["y0"]]], 3, "Newton derivative")
    slope3 = ev.poly(s, 3.0 * derivative(net.isqrt))
    y0sq = ev.square(y0)
    inner = ev.shift(ev.neg(ev.mul(s, y0sq)), 1.0)
    dY = ev.sub(ev.mul(slope3, inner), ev.mul(y0sq, y0))
    [[dy, dY]] = fit(ev, [[dy, dY]], 1, "variance grad")
    ds = ev.mul(dy, dY)
    [ds], c = fit(ev, [[ds], c], 1, "centring grad")
    twice = [ev.mul(ds, cf) for cf in c]
    dc = [ev.add(x, ev.add(tw, tw)) for x, tw in zip(dc, twice, strict=True)]
    [dc] = fit(ev, [dc], 1, "centring")
    dh = [ev.add(a, b) for a, b in zip(do, ev.linear(dc, net.centre.T), strict=True)]
    datt = dense("wo", cache["att"], dh)
    if net.attention == "gk":
        dq, dks, dvs = gk_backward(ev, net, datt, cache)
    else:
        dq, dks, dvs = softmax_backward(ev, net, datt, cache)
    d = len(dq)
    back = unroll([dks[s] + dvs[s] for s in range(len(dks))])
    ev.note("unroll_rounds")
    z = cache["z"]
    for name, dx in (("q", dq), ("k", back[:d]), ("v", back[d:])):
        if net.lora:
            [dx] = fit(ev, [dx], 1, "LoRA grad")
            gb = matmul_t(ev, dx, m[f"{name}_b"])
            zz, gb = fit(ev, [z, gb], 1, "LoRA A grad")
            grads[f"{name}_a"] = outer_sums(ev, zz, gb)
            low, dx = fit(ev, [cache[f"{name}_low"], dx], 1, "LoRA B grad")
            grads[f"{name}_b"] = outer_sums(ev, low, dx)
        else:
            zz, dx = fit(ev, [z, dx], 1, "weight grad")
            grads[f"w{name}"] = outer_sums(ev, zz, dx)
    return {k: grads[k] for k in net.trained}


@dataclass
class NormCache:
    """What the backward pass of one polynomial LayerNorm reads."""

    centred: list[Value]
    scaled: list[Value]
    sigma: Value
    ys: list[Value]
    """:math:`y_0, \\ldots, y_K` (the inverse-sqrt fit and each Newton step)."""


def norm_forward(
    ev: Evaluator, x: list[Value], w: NormWeights, newton: int, stage: str
) -> tuple[list[Value], NormCache]:
    """:func:`crypto.program.encoder.layer_norm`, keeping its intermediates."""
    x = ev.ensure(x, 2, f"{stage} statistics")
    centred = ev.linear(x, w.stats)
    scaled = ev.linear(x, w.out)
    sigma = ev.total([ev.square(c) for c in centred])
    [sigma] = ev.ensure([sigma], depth(w.isqrt), f"{stage} inverse sqrt")
    ys = [ev.poly(sigma, w.isqrt)]
    for _ in range(newton):
        [[s, y]] = fit(ev, [[sigma, ys[-1]]], 3, f"{stage} Newton")
        ys[-1] = y
        ys.append(ev.mul(y, ev.shift(ev.neg(ev.mul(s, ev.square(y))), 1.5)))
    scaled, [y] = fit(ev, [scaled, [ys[-1]]], 1, f"{stage} scale")
    out = [
        ev.shift(ev.mul(s, y), float(b)) for s, b in zip(scaled, w.beta, strict=True)
    ]
    return out, NormCache(centred, scaled, sigma, ys)


def norm_backward(
    ev: Evaluator, w: NormWeights, cache: NormCache, dout: list[Value], stage: str
) -> list[Value]:
    """The gradient of the LayerNorm's input (module docstring, :math:`LN^*`)."""
    dout, scaled, [y] = fit(ev, [dout, cache.scaled, [cache.ys[-1]]], 1, stage)
    dscaled = [ev.mul(g, y) for g in dout]
    dy = ev.total([ev.mul(g, s) for g, s in zip(dout, scaled, strict=True)])
    dsigma: Value | None = None
    for k in range(len(cache.ys) - 2, -1, -1):
        [[s, yk, dy]] = fit(ev, [[cache.sigma, cache.ys[k], dy]], 4, f"{stage} Newton")
        ysq = ev.square(yk)
        slope = ev.shift(ev.scale(ev.mul(s, ysq), -3.0), 1.5)
        part = ev.neg(ev.mul(dy, ev.mul(ysq, yk)))
        dsigma = part if dsigma is None else ev.add(dsigma, part)
        dy = ev.mul(dy, slope)
    [[s]] = fit(ev, [[cache.sigma]], depth(w.isqrt), f"{stage} inverse sqrt grad")
    slope0 = ev.poly(s, derivative(w.isqrt))
    [[dy, slope0]] = fit(ev, [[dy, slope0]], 1, f"{stage} inverse sqrt grad")
    part = ev.mul(dy, slope0)
    dsigma = part if dsigma is None else ev.add(dsigma, part)
    [[dsigma], centred] = fit(ev, [[dsigma], cache.centred], 1, f"{stage} centring")
    dcentred = [ev.mul(dsigma, c) for c in centred]
    dcentred = [ev.add(x, x) for x in dcentred]
    dscaled, dcentred = fit(ev, [dscaled, dcentred], 1, f"{stage} input grad")
    back = matmul(ev, dscaled, w.out.T)
    return [
        ev.add(a, b) for a, b in zip(back, matmul(ev, dcentred, w.stats.T), strict=True)
    ]


def frozen_block(
    ev: Evaluator,
    w: BertWeights,
    i: int,
    z: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll,
) -> list[Value]:
    """Block ``i`` of :func:`crypto.program.encoder.encode` (forward only)."""
    bw = w.blocks[i]
    attended = _attention(ev, w, bw, z, masks, lora, roll, i)
    projected = affine(ev, attended, bw.wo, bw.bo)
    h = [ev.add(a, b) for a, b in zip(z, projected, strict=True)]
    h = layer_norm(ev, h, bw.norm1, w.newton_steps, f"layer {i} LayerNorm 1")
    hidden = _mapped(ev, h, bw.w1, bw.b1, bw.act, f"layer {i} feed-forward")
    hidden = ev.ensure(hidden, 1, f"layer {i} feed-forward output")
    out = [
        ev.add(a, b) for a, b in zip(h, affine(ev, hidden, bw.w2, bw.b2), strict=True)
    ]
    return layer_norm(ev, out, bw.norm2, w.newton_steps, f"layer {i} LayerNorm 2")


def _kernel_net(w: BertWeights, bw: BlockWeights) -> Net:
    """The attention part of a :class:`~crypto.program.net.Net` (kernel passes)."""
    return Net(
        "gk", w.heads, w.n_tokens, {}, (), bw.norm1.stats, bw.act, bw.norm1.isqrt,
        w.tanh, bw.gk,
    )  # fmt: skip


def _poly_grad(
    ev: Evaluator, pre: list[Value], poly: FloatArray, dout: list[Value], stage: str
) -> list[Value]:
    """Back through ``poly`` applied slot-wise to ``pre``."""
    coefficients = derivative(poly)
    [pre] = fit(ev, [pre], depth(coefficients), f"{stage} derivative")
    slope = [ev.poly(x, coefficients) for x in pre]
    dout, slope = fit(ev, [dout, slope], 1, f"{stage} grad")
    return [ev.mul(a, b) for a, b in zip(dout, slope, strict=True)]


def _block_forward(
    ev: Evaluator,
    w: BertWeights,
    i: int,
    z: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll,
) -> tuple[list[Value], dict[str, Any]]:
    """Block ``i``'s forward pass and what its backward pass reads."""
    d, n = w.d, w.n_tokens
    bw, tag = w.blocks[i], f"layer {i}"
    cache: dict[str, Any] = {}
    [z] = fit(ev, [z], 2, f"{tag} qkv")
    proj, low = {}, {}
    for name, W, b in (("q", bw.wq, bw.bq), ("k", bw.wk, bw.bk), ("v", bw.wv, bw.bv)):
        A, B = lora[f"{tag} {name}_a"], lora[f"{tag} {name}_b"]
        low[name] = matmul(ev, z, A)
        up = matmul(ev, low[name], B)
        proj[name] = [
            ev.shift(ev.add(x, u), float(c))
            for x, u, c in zip(ev.linear(z, W), up, b, strict=True)
        ]
    rolled = roll(proj["k"] + proj["v"], n)
    ev.note("roll_rounds")
    ks = [r[:d] for r in rolled]
    vs = []
    for s, r in enumerate(rolled):
        vals, [mk] = fit(ev, [r[d:], [masks[s]]], 1, f"{tag} key weights")
        vs.append([ev.mul(x, mk) for x in vals])
    att = gk_forward(ev, _kernel_net(w, bw), proj["q"], ks, vs, cache)
    [att] = fit(ev, [att], 1, f"{tag} output projection")
    h = [ev.add(a, b) for a, b in zip(z, affine(ev, att, bw.wo, bw.bo), strict=True)]
    h, norm1 = norm_forward(ev, h, bw.norm1, w.newton_steps, f"{tag} LayerNorm 1")
    [h] = fit(ev, [h], 1, f"{tag} feed-forward")
    [a] = fit(ev, [affine(ev, h, bw.w1, bw.b1)], depth(bw.act), f"{tag} activation")
    [hid] = fit(ev, [[ev.poly(x, bw.act) for x in a]], 1, f"{tag} feed-forward out")
    out = [ev.add(x, f) for x, f in zip(h, affine(ev, hid, bw.w2, bw.b2), strict=True)]
    z2, norm2 = norm_forward(ev, out, bw.norm2, w.newton_steps, f"{tag} LayerNorm 2")
    cache.update(z=z, low=low, norm1=norm1, a=a, norm2=norm2)
    return z2, cache


def _block_backward(
    ev: Evaluator,
    w: BertWeights,
    i: int,
    cache: dict[str, Any],
    dz: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    unroll: Unroll,
    want_input: bool,
) -> tuple[dict[str, list[list[Value]]], list[Value] | None]:
    r"""Block ``i``'s LoRA gradient sums and, if wanted, its input's gradient.

    The input gradient is the residual's plus, for each of Q, K, V,
    :math:`\bar x' W_x^T + (\bar x' B_x^T) A_x^T`.
    """
    d, n = w.d, w.n_tokens
    bw, tag = w.blocks[i], f"layer {i}"
    dout = norm_backward(ev, bw.norm2, cache["norm2"], dz, f"{tag} LayerNorm 2 grad")
    [dout] = fit(ev, [dout], 1, f"{tag} feed-forward grad")
    a = cache["a"]
    da = _poly_grad(ev, a, bw.act, matmul_t(ev, dout, bw.w2), f"{tag} activation")
    [da] = fit(ev, [da], 1, f"{tag} feed-forward input grad")
    dh = [ev.add(x, y) for x, y in zip(dout, matmul_t(ev, da, bw.w1), strict=True)]
    dh = norm_backward(ev, bw.norm1, cache["norm1"], dh, f"{tag} LayerNorm 1 grad")
    [dh] = fit(ev, [dh], 1, f"{tag} output projection grad")
    net = _kernel_net(w, bw)
    dq, dks, dvs = gk_backward(ev, net, matmul_t(ev, dh, bw.wo), cache)
    for s in range(n):
        vals, [mk] = fit(ev, [dvs[s], [masks[s]]], 1, f"{tag} key weights grad")
        dvs[s] = [ev.mul(x, mk) for x in vals]
    back = unroll([dks[s] + dvs[s] for s in range(n)])
    ev.note("unroll_rounds")
    grads: dict[str, list[list[Value]]] = {}
    dz_in = dh if want_input else None
    for name, dx in (("q", dq), ("k", back[:d]), ("v", back[d:])):
        A, B = lora[f"{tag} {name}_a"], lora[f"{tag} {name}_b"]
        [dx] = fit(ev, [dx], 1, f"{tag} LoRA grad")
        zz, gb = fit(ev, [cache["z"], matmul_t(ev, dx, B)], 1, f"{tag} LoRA A grad")
        grads[f"{tag} {name}_a"] = outer_sums(ev, zz, gb)
        lo, dx = fit(ev, [cache["low"][name], dx], 1, f"{tag} LoRA B grad")
        grads[f"{tag} {name}_b"] = outer_sums(ev, lo, dx)
        if dz_in is not None:
            W = getattr(bw, f"w{name}")
            [gb] = fit(ev, [gb], 1, f"{tag} input grad")
            part = [
                ev.add(x, y)
                for x, y in zip(matmul_t(ev, dx, W), matmul_t(ev, gb, A), strict=True)
            ]
            dz_in = [ev.add(x, y) for x, y in zip(dz_in, part, strict=True)]
    return grads, dz_in


def lora_gradients(
    ev: Evaluator,
    w: BertWeights,
    z: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll,
    unroll: Unroll,
    Y: list[Value],
    m: FloatArray,
    trained: int = 1,
) -> dict[str, list[list[Value]]]:
    """Encrypted gradient sums of the last ``trained`` blocks' Q/K/V factors.

    Keys ``"layer {i} q_a"`` ... ``"layer {i} v_b"``; ``Y`` holds the one-hot
    targets on the CLS slots, ``m`` the public loss mask (module docstring);
    ``lora`` the folded factors of every block. Blocks before the trained ones run
    frozen (forward only).
    """
    d, n, depth_ = w.d, w.n_tokens, len(w.blocks)
    if len(z) != d or len(masks) != n:
        raise ValueError(f"expected {d} feature and {n} key-weight values")
    if not 1 <= trained <= depth_:
        raise ValueError(f"trained: expected 1 to {depth_} blocks, got {trained}")
    first = depth_ - trained
    for i in range(first):
        z = frozen_block(ev, w, i, z, masks, lora, roll)
    caches = []
    for i in range(first, depth_):
        z, cache = _block_forward(ev, w, i, z, masks, lora, roll)
        caches.append(cache)
    [z] = fit(ev, [z], 1, "pooler")
    [t] = fit(ev, [affine(ev, z, w.pool, w.pool_bias)], depth(w.tanh), "tanh")
    [pooled] = fit(ev, [[ev.poly(x, w.tanh) for x in t]], 1, "classifier")
    logits = affine(ev, pooled, w.classifier, w.classifier_bias)
    # Backward.
    diff = [ev.sub(a, y) for a, y in zip(logits, Y, strict=True)]
    [diff] = fit(ev, [diff], 1, "loss")
    dlogits = [ev.mask(x, m) for x in diff]
    [dlogits] = fit(ev, [dlogits], 1, "classifier grad")
    dt = _poly_grad(ev, t, w.tanh, matmul_t(ev, dlogits, w.classifier), "tanh")
    [dt] = fit(ev, [dt], 1, "pooler grad")
    dz: list[Value] | None = matmul_t(ev, dt, w.pool)
    grads: dict[str, list[list[Value]]] = {}
    for i in range(depth_ - 1, first - 1, -1):
        assert dz is not None
        found, dz = _block_backward(
            ev, w, i, caches[i - first], dz, masks, lora, unroll, i > first
        )
        grads.update(found)
    return {
        f"layer {i} {x}_{f}": grads[f"layer {i} {x}_{f}"]
        for i in range(first, depth_)
        for x in LORA
        for f in "ab"
    }


def head_gradients(
    ev: Evaluator,
    w: BertWeights,
    pooled: list[Value],
    A: list[list[Value]],
    B: list[list[Value]],
    Y: list[Value],
    m: FloatArray,
) -> tuple[list[list[Value]], list[list[Value]]]:
    """Encrypted gradient sums (grad A, grad B) of the classifier adapter."""
    rank = len(B)
    pooled = ev.ensure(pooled, 2, "head LoRA forward")
    low = [
        ev.total([ev.mul(p, A[g][r]) for g, p in enumerate(pooled)])
        for r in range(rank)
    ]
    base = affine(ev, pooled, w.classifier, w.classifier_bias)
    logits = [
        ev.add(base[c], ev.total([ev.mul(low[r], B[r][c]) for r in range(rank)]))
        for c in range(len(base))
    ]
    diff = [ev.sub(a, y) for a, y in zip(logits, Y, strict=True)]
    flat = ev.ensure(diff + low + pooled, 3, "head LoRA gradients")
    C = len(diff)
    G = [ev.mask(x, m) for x in flat[:C]]
    low, pooled = flat[C : C + rank], flat[C + rank :]
    grad_b = [[ev.slot_sum(ev.mul(low[r], g)) for g in G] for r in range(rank)]
    gb = [ev.total([ev.mul(G[c], B[r][c]) for c in range(C)]) for r in range(rank)]
    grad_a = [[ev.slot_sum(ev.mul(p, gb[r])) for r in range(rank)] for p in pooled]
    return grad_a, grad_b
