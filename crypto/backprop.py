r"""One fine-tuning step of the HE-friendly layer on packed values: both passes.

The layer of :mod:`crypto.heval` (feature-major layout, slot ``b n + i`` = token
``i`` of sequence ``b``), differentiated by hand so that the backward pass is made of
the same slot-wise operations as the forward pass (Rho et al., 2025, train the
LoRA factors and the head under HE the same way, with bootstrapping). With the
squared error :math:`L = \tfrac1{2B}\sum_b \lVert \ell_b - y_b\rVert^2` on the CLS
logits, the gradient of the logits is :math:`m \odot (\ell - Y)` with the public
mask ``m`` (``1/B`` on CLS slots, 0 elsewhere), and, writing :math:`\bar x` for
:math:`\partial L/\partial x`:

.. math::

    \bar W_c &= \textstyle\sum_t p\,\bar\ell^T, & \bar t &= (\bar\ell W_c^T)\odot
        \tau'(t), & \bar W_p &= \textstyle\sum_t o\,\bar t^T,\\
    \bar o &= \bar t W_p^T, & \bar a &= (\bar o W_2^T)\odot\phi'(a),
        & \bar u &= \bar a W_1^T,\\
    \bar c &= \bar u\,y + 2\,\bar s\,c, & \bar s &= (\bar u\cdot c)\,Y'(s),
        & \bar h &= \bar o + \bar c\,C^T,

where :math:`Y(s) = p(s)(3 - s p(s)^2)` is the (doubled) Newton-refined inverse square
root, :math:`C` the centring matrix, :math:`\sum_t` a slot sum (rotate-and-add with
Galois keys). Gaussian-kernel attention per shift ``s`` (rolled copies
:math:`k_s, v_s`, :math:`w_s = g(u_s)`, :math:`u_s = \sum_f (q_f - k_{s,f})^2`):

.. math::

    \bar v_{s} = \bar o_{att}\, w_s, \quad
    \bar u_s = g'(u_s) \textstyle\sum_f \bar o_{att,f} v_{s,f}, \quad
    \bar q = \textstyle\sum_s 2\bar u_s (q - k_s), \quad \bar k_s = -2\bar u_s(q-k_s).

The rolled gradients :math:`\bar k_s, \bar v_s` are rolled back and summed by the key
owner (a counted round trip; the layout stays rotation-free, like the forward roll).
LoRA factors get :math:`\bar A = \sum_t z\,(\bar q B^T)^T` and
:math:`\bar B = \sum_t (zA)\,\bar q^T`; encrypted full weights get
:math:`\bar W = \sum_t x\,\bar y^T`. Every stage first *fits* its operands into the
modulus chain: values that would overrun it are refreshed by the key owner
(client-aided, counted), never bootstrapped.

The polynomial-softmax baseline (:func:`crypto.heval.softmax_attention`) is
differentiated the same way, with :math:`\partial(1/S)/\partial S = -y^2` evaluated on
the refined reciprocal :math:`y`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from crypto.heval import Evaluator, SoftmaxPolys, Value

FloatArray = npt.NDArray[np.float64]
Matrix = FloatArray | list[list[Value]]
Unroll = Callable[[list[list[Value]]], list[Value]]
Roll = Callable[[list[Value], int], list[list[Value]]]
LORA_TRAINED = ("q_a", "q_b", "k_a", "k_b", "v_a", "v_b", "pool", "classifier")
FULL_TRAINED = ("wq", "wk", "wv", "wo", "w1", "w2", "pool", "classifier")


def derivative(coefficients: FloatArray) -> FloatArray:
    """Coefficients (low to high) of the derivative polynomial."""
    c = np.asarray(coefficients, dtype=np.float64)
    if c.size < 2:
        raise ValueError("a polynomial of degree >= 1 is needed")
    out: FloatArray = c[1:] * np.arange(1, c.size)
    return out


@dataclass
class Net:
    """HE-ready weights of one fine-tuning arm (scales folded as in ``HEWeights``).

    Parameters
    ----------
    attention : {"gk", "softmax"}
        Gaussian kernel or the polynomial-softmax baseline.
    heads, n_tokens : int
        Attention heads and sequence length.
    mats : dict
        ``wq, wk, wv, wo, w1, w2, pool, classifier`` and, in the LoRA arm,
        ``q_a, q_b, k_a, k_b, v_a, v_b``; a trained matrix holds encrypted (or
        simulated) entries, one replicated value each, a frozen one a public array.
    trained : tuple of str
        Names of the trained matrices.
    centre, act, isqrt, tanh, gk : arrays
        Public LayerNorm centring matrix and polynomial coefficients.
    softmax : SoftmaxPolys or None
        Polynomials of the softmax baseline (``attention == "softmax"``).
    """

    attention: str
    heads: int
    n_tokens: int
    mats: dict[str, Matrix]
    trained: tuple[str, ...]
    centre: FloatArray
    act: FloatArray
    isqrt: FloatArray
    tanh: FloatArray
    gk: FloatArray
    softmax: SoftmaxPolys | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("gk", "softmax"):
            raise ValueError(
                f"Net.attention must be gk or softmax, not {self.attention}"
            )
        if self.attention == "softmax" and self.softmax is None:
            raise ValueError("the softmax arm needs its SoftmaxPolys")
        missing = [t for t in self.trained if t not in self.mats]
        if missing:
            raise ValueError(f"trained matrices {missing} are not in Net.mats")

    @property
    def lora(self) -> bool:
        """Whether Q, K, V carry LoRA factors."""
        return "q_a" in self.mats


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


def _heads(net: Net, d: int) -> list[list[int]]:
    dh = d // net.heads
    return [list(range(h * dh, (h + 1) * dh)) for h in range(net.heads)]


def _gk_forward(
    ev: Evaluator,
    net: Net,
    q: list[Value],
    ks: list[list[Value]],
    vs: list[list[Value]],
    cache: dict[str, Any],
) -> list[Value]:
    d, n = len(q), len(ks)
    q, *ks = fit(ev, [q, *ks], 1, "kernel distance")
    out: list[Value] = [Value(None)] * d
    per_head = []
    for cols in _heads(net, d):
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


def _gk_backward(
    ev: Evaluator, net: Net, datt: list[Value], cache: dict[str, Any]
) -> tuple[list[Value], list[list[Value]], list[list[Value]]]:
    d = len(datt)
    per_head = cache["attention"]
    n = len(per_head[0]["u"])
    dq: list[Value] = [Value(None)] * d
    dks = [[Value(None)] * d for _ in range(n)]
    dvs = [[Value(None)] * d for _ in range(n)]
    gk_d = derivative(net.gk)
    for cols, saved in zip(_heads(net, d), per_head, strict=True):
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


def _softmax_forward(
    ev: Evaluator,
    net: Net,
    q: list[Value],
    ks: list[list[Value]],
    vs: list[list[Value]],
    cache: dict[str, Any],
) -> list[Value]:
    assert net.softmax is not None
    polys = net.softmax
    d, n = len(q), len(ks)
    out: list[Value] = [Value(None)] * d
    per_head = []
    for cols in _heads(net, d):
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


def _softmax_backward(
    ev: Evaluator, net: Net, datt: list[Value], cache: dict[str, Any]
) -> tuple[list[Value], list[list[Value]], list[list[Value]]]:
    assert net.softmax is not None
    d = len(datt)
    per_head = cache["attention"]
    n = len(per_head[0]["scores"])
    dq: list[Value] = [Value(None)] * d
    dks = [[Value(None)] * d for _ in range(n)]
    dvs = [[Value(None)] * d for _ in range(n)]
    exp_d = derivative(net.softmax.exp)
    for cols, sv in zip(_heads(net, d), per_head, strict=True):
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
        att = _gk_forward(ev, net, q, ks, vs, cache)
    else:
        att = _softmax_forward(ev, net, q, ks, vs, cache)
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
        dq, dks, dvs = _gk_backward(ev, net, datt, cache)
    else:
        dq, dks, dvs = _softmax_backward(ev, net, datt, cache)
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
