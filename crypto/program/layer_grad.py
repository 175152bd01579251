r"""Backward passes of the program's non-linear layers, read from the training trace.

**Polynomial LayerNorm** :math:`o_f = \hat x_f\, y + \beta_f` (:math:`\hat x = x O`,
:math:`c = x S`, :math:`\sigma = \sum_f c_f^2`, :math:`y_0 = P(\sigma)`,
:math:`y_{k+1} = y_k(\gamma - \sigma y_k^2)`), differentiated as evaluated:

.. math::

    \bar{\hat x} = \bar o\, y, \quad \bar y_K = \textstyle\sum_f \bar o_f \hat x_f,
    \quad \bar y_k = \bar y_{k+1}(\gamma - 3\sigma y_k^2), \quad
    \bar\sigma = \textstyle\sum_k -\bar y_{k+1} y_k^3 + \bar y_0 P'(\sigma),\quad
    \bar x = \bar{\hat x} O^T + 2\bar\sigma\, c\, S^T.

The HEFormer's norm (one Newton step, :math:`\gamma = 3`, no :math:`O`, no
:math:`\beta`) keeps its fused form :math:`dY/d\sigma = 3P'(1 - \sigma P^2) - P^3`
(:func:`fused_norm_backward`; same value, the schedule its clients derive).

**Gaussian-kernel attention** per shift ``s`` (:math:`w_s = g(u_s)`,
:math:`u_s = \sum_f (q_f - k_{s,f})^2`): :math:`\bar v_s = \bar a\, w_s`,
:math:`\bar u_s = g'(u_s)\sum_f \bar a_f v_{s,f}`,
:math:`\bar q = \sum_s 2\bar u_s (q - k_s)`, :math:`\bar k_s = -2\bar u_s(q - k_s)`.
**Polynomial softmax** the same way, with :math:`\partial(1/S)/\partial S = -y^2`
on the refined reciprocal :math:`y`.
"""

from __future__ import annotations

import numpy as np

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Value
from .attention import SoftmaxPolys, heads
from .blocks import matmul
from .run import Trace, fit
from .spec import Block, Norm, Program, depth

Grads = tuple[list[Value], list[list[Value]], list[list[Value]]]


def derivative(coefficients: FloatArray) -> FloatArray:
    """Coefficients (low to high) of the derivative polynomial."""
    c = np.asarray(coefficients, dtype=np.float64)
    if c.size < 2:
        raise ValueError("a polynomial of degree >= 1 is needed")
    out: FloatArray = c[1:] * np.arange(1, c.size)
    return out


def norm_backward(
    ev: Evaluator, w: Norm, trace: Trace, dout: list[Value]
) -> list[Value]:
    """The gradient of the LayerNorm's input (module docstring)."""
    st = w.stage
    stage = f"{st} grad"
    ys, [sigma] = trace[f"{st} ys"], trace[f"{st} sigma"]
    dout, scaled, [y] = fit(ev, [dout, trace[f"{st} scaled"], [ys[-1]]], 1, stage)
    dscaled = [ev.mul(g, y) for g in dout]
    dy = ev.total([ev.mul(g, s) for g, s in zip(dout, scaled, strict=True)])
    dsigma: Value | None = None
    for k in range(len(ys) - 2, -1, -1):
        [[s, yk, dy]] = fit(ev, [[sigma, ys[k], dy]], 4, f"{stage} Newton")
        ysq = ev.square(yk)
        slope = ev.shift(ev.scale(ev.mul(s, ysq), -3.0), w.newton_shift)
        part = ev.neg(ev.mul(dy, ev.mul(ysq, yk)))
        dsigma = part if dsigma is None else ev.add(dsigma, part)
        dy = ev.mul(dy, slope)
    [[s]] = fit(ev, [[sigma]], depth(w.isqrt), f"{stage} inverse sqrt grad")
    slope0 = ev.poly(s, derivative(w.isqrt))
    [[dy, slope0]] = fit(ev, [[dy, slope0]], 1, f"{stage} inverse sqrt grad")
    part = ev.mul(dy, slope0)
    dsigma = part if dsigma is None else ev.add(dsigma, part)
    [[dsigma], centred] = fit(
        ev, [[dsigma], trace[f"{st} centred"]], 1, f"{stage} centring"
    )
    dcentred = [ev.mul(dsigma, c) for c in centred]
    dcentred = [ev.add(x, x) for x in dcentred]
    dscaled, dcentred = fit(ev, [dscaled, dcentred], 1, f"{stage} input grad")
    out = w.stats if w.out is None else w.out
    back = matmul(ev, dscaled, out.T)
    return [
        ev.add(a, b) for a, b in zip(back, matmul(ev, dcentred, w.stats.T), strict=True)
    ]


def fused_norm_backward(
    ev: Evaluator, w: Norm, trace: Trace, du: list[Value], residual: list[Value]
) -> list[Value]:
    r"""``residual`` plus the HEFormer norm's input gradient (fused form, 1 step).

    :math:`Y(\sigma) = P(\sigma)(\gamma - \sigma P(\sigma)^2)` with :math:`\gamma =
    3`; :math:`\bar c = \bar u\, y + 2\bar\sigma c`,
    :math:`\bar\sigma = (\bar u\cdot c)\,Y'(\sigma)`, :math:`\bar h = \bar c S^T`.
    """
    st = w.stage
    du, c, [y] = fit(
        ev, [du, trace[f"{st} centred"], trace[f"{st} y"]], 1, f"{st} grad"
    )
    dc = [ev.mul(x, y) for x in du]
    dy = ev.total([ev.mul(x, cf) for x, cf in zip(du, c, strict=True)])
    pair = [trace[f"{st} sigma 0"][0], trace[f"{st} ys"][0]]
    [[s, y0]] = fit(ev, [pair], 3, "Newton derivative")
    slope3 = ev.poly(s, w.newton_shift * derivative(w.isqrt))
    y0sq = ev.square(y0)
    inner = ev.shift(ev.neg(ev.mul(s, y0sq)), 1.0)
    dY = ev.sub(ev.mul(slope3, inner), ev.mul(y0sq, y0))
    [[dy, dY]] = fit(ev, [[dy, dY]], 1, "variance grad")
    ds = ev.mul(dy, dY)
    [ds], c = fit(ev, [[ds], c], 1, "centring grad")
    twice = [ev.mul(ds, cf) for cf in c]
    dc = [ev.add(x, ev.add(tw, tw)) for x, tw in zip(dc, twice, strict=True)]
    [dc] = fit(ev, [dc], 1, "centring")
    back = ev.linear(dc, w.stats.T)
    return [ev.add(a, b) for a, b in zip(residual, back, strict=True)]


def _empty(p: Program) -> Grads:
    """Placeholders for the query, key and value gradients (filled per head)."""
    d, n = p.d, p.n_tokens
    return (
        [Value(None)] * d,
        [[Value(None)] * d for _ in range(n)],
        [[Value(None)] * d for _ in range(n)],
    )


def attention_backward(
    ev: Evaluator,
    p: Program,
    b: Block,
    trace: Trace,
    datt: list[Value],
    polys: SoftmaxPolys | None,
) -> Grads:
    """Gradients of the queries and of each shift's keys and values, head by head.

    The Gaussian kernel, or the polynomial softmax when ``polys`` is given.
    """
    grads = _empty(p)
    for h, cols in enumerate(heads(p.d, p.heads)):
        tag = f"{b.prefix}head {h} "
        dcol = [datt[f] for f in cols]
        if polys is None:
            _gk_head(ev, b, trace, tag, cols, dcol, grads)
        else:
            _softmax_head(ev, trace, tag, cols, dcol, grads, polys)
    return grads


def _gk_head(
    ev: Evaluator,
    b: Block,
    trace: Trace,
    tag: str,
    cols: list[int],
    dcol: list[Value],
    grads: Grads,
) -> None:
    """One head of the kernel's backward pass, written into ``grads``."""
    dq, dks, dvs = grads
    n = len(dks)
    gk_d = derivative(b.gk)
    dcol, *vh = fit(
        ev, [dcol, *(trace[f"{tag}v {s}"] for s in range(n))], 1, "kernel grad"
    )
    g = [
        ev.total([ev.mul(dcol[i], vh[s][i]) for i in range(len(cols))])
        for s in range(n)
    ]
    dcol, w = fit(ev, [dcol, trace[f"{tag}w"]], 1, "value grad")
    for s in range(n):
        for i, f in enumerate(cols):
            dvs[s][f] = ev.mul(dcol[i], w[s])
    [u] = fit(ev, [trace[f"{tag}u"]], 3, "kernel derivative")
    slope = [ev.poly(x, gk_d) for x in u]
    g, slope = fit(ev, [g, slope], 1, "distance grad")
    du = [ev.mul(a, c) for a, c in zip(g, slope, strict=True)]
    for s in range(n):
        [dus], diff = fit(ev, [[du[s]], trace[f"{tag}diff {s}"]], 1, "difference grad")
        for i, f in enumerate(cols):
            half = ev.mul(dus, diff[i])
            ddiff = ev.add(half, half)
            dks[s][f] = ev.neg(ddiff)
            dq[f] = ddiff if s == 0 else ev.add(dq[f], ddiff)


def _softmax_head(
    ev: Evaluator,
    trace: Trace,
    tag: str,
    cols: list[int],
    dcol: list[Value],
    grads: Grads,
    polys: SoftmaxPolys,
) -> None:
    """One head of the softmax's backward pass, written into ``grads``."""
    dq, dks, dvs = grads
    n = len(dks)
    exp_d = derivative(polys.exp)
    saved_y = trace[f"{tag}y"]
    dcol, [y] = fit(ev, [dcol, saved_y], 1, "softmax grad")
    dacc = [ev.mul(x, y) for x in dcol]
    dcol, acc = fit(ev, [dcol, trace[f"{tag}acc"]], 1, "softmax grad")
    dy = ev.total([ev.mul(a, c) for a, c in zip(dcol, acc, strict=True)])
    [[y]] = fit(ev, [saved_y], 1, "softmax grad")
    [[dy, ysq]] = fit(ev, [[dy, ev.square(y)]], 1, "softmax grad")
    dtotal = ev.neg(ev.mul(dy, ysq))
    vs = [trace[f"{tag}v {s}"] for s in range(n)]
    dacc, *vh = fit(ev, [dacc, *vs], 1, "softmax value")
    de = [
        ev.total([ev.mul(dacc[i], vh[s][i]) for i in range(len(cols))])
        for s in range(n)
    ]
    de = [ev.add(x, dtotal) for x in de]
    [scores] = fit(ev, [trace[f"{tag}scores"]], 3, "exp derivative")
    slope = [ev.poly(x, exp_d) for x in scores]
    de, slope = fit(ev, [de, slope], 1, "score grad")
    dsc = [ev.mul(a, c) for a, c in zip(de, slope, strict=True)]
    ks = [trace[f"{tag}k {s}"] for s in range(n)]
    dsc, *kh = fit(ev, [dsc, *ks], 1, "query grad")
    for i, f in enumerate(cols):
        dq[f] = ev.total([ev.mul(dsc[s], kh[s][i]) for s in range(n)])
    dsc, qh = fit(ev, [dsc, trace[f"{tag}q"]], 1, "key grad")
    dacc, e = fit(ev, [dacc, trace[f"{tag}e"]], 1, "value grad")
    for s in range(n):
        for i, f in enumerate(cols):
            dks[s][f] = ev.mul(dsc[s], qh[i])
            dvs[s][f] = ev.mul(dacc[i], e[s])
