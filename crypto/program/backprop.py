r"""One fine-tuning step of the HE-friendly layer on packed values: both passes.

The layer of :mod:`crypto.program.heformer` (feature-major layout, slot ``b n + i`` =
token ``i`` of sequence ``b``), differentiated by hand so that the backward pass is made
of the same slot-wise operations as the forward pass (Rho et al., 2025, train the LoRA
factors and the head under HE the same way, with bootstrapping). With the squared error
:math:`L = \tfrac1{2B}\sum_b \lVert \ell_b - y_b\rVert^2` on the CLS logits, the
gradient of the logits is :math:`m \odot (\ell - Y)` with the public mask ``m`` (``1/B``
on CLS slots, 0 elsewhere), and, writing :math:`\bar x` for :math:`\partial L/\partial
x`:

.. math::

    \bar W_c &= \textstyle\sum_t p\,\bar\ell^T, & \bar t &= (\bar\ell W_c^T)\odot
        \tau'(t), & \bar W_p &= \textstyle\sum_t o\,\bar t^T,\\
    \bar o &= \bar t W_p^T, & \bar a &= (\bar o W_2^T)\odot\phi'(a),
        & \bar u &= \bar a W_1^T,\\
    \bar c &= \bar u\,y + 2\,\bar s\,c, & \bar s &= (\bar u\cdot c)\,Y'(s),
        & \bar h &= \bar o + \bar c\,C^T,

where :math:`Y(s) = p(s)(3 - s p(s)^2)` is the (doubled) Newton-refined inverse square
root, :math:`C` the centring matrix, :math:`\sum_t` a slot sum (rotate-and-add with
Galois keys). The attention passes are in :mod:`crypto.program.attention_grad`.

The rolled gradients :math:`\bar k_s, \bar v_s` are rolled back and summed by the key
owner (a counted round trip; the layout stays rotation-free, like the forward roll).
LoRA factors get :math:`\bar A = \sum_t z\,(\bar q B^T)^T` and
:math:`\bar B = \sum_t (zA)\,\bar q^T`; encrypted full weights get
:math:`\bar W = \sum_t x\,\bar y^T`. Every stage first *fits* its operands into the
modulus chain: values that would overrun it are refreshed by the key owner
(client-aided, counted), never bootstrapped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Value
from .attention_grad import gk_backward, gk_forward, softmax_backward, softmax_forward
from .net import Net, derivative, fit, matmul, matmul_t, outer_sums

Unroll = Callable[[list[list[Value]]], list[Value]]
Roll = Callable[[list[Value], int], list[list[Value]]]


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
