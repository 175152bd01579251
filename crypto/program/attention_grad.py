r"""Both attentions of the fine-tuning layer, forward and backward, on packed values.

Gaussian-kernel attention per shift ``s`` (rolled copies :math:`k_s, v_s`,
:math:`w_s = g(u_s)`, :math:`u_s = \sum_f (q_f - k_{s,f})^2`):

.. math::

    \bar v_{s} = \bar o_{att}\, w_s, \quad
    \bar u_s = g'(u_s) \textstyle\sum_f \bar o_{att,f} v_{s,f}, \quad
    \bar q = \textstyle\sum_s 2\bar u_s (q - k_s), \quad \bar k_s = -2\bar u_s(q-k_s).

The polynomial-softmax baseline (:func:`crypto.program.heformer.softmax_attention`) is
differentiated the same way, with :math:`\partial(1/S)/\partial S = -y^2` evaluated on
the refined reciprocal :math:`y`. Each forward pass stores in ``cache["attention"]``
what its backward pass reads.
"""

from __future__ import annotations

from typing import Any

from ..he.evaluator import Evaluator, Value
from .net import Net, derivative, fit, heads_of


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
