r"""Attention on rolled copies: the Gaussian kernel and the polynomial-softmax baseline.

Copy ``s`` of K and V holds token ``(i + s) mod n`` in slot ``i`` (the rotation-free
layout of :mod:`crypto.he.packing`), so the scores of shift ``s`` are slot-wise: the
Gaussian kernel's :math:`u_s = \sum_{f\in h}(q_f - k_{s,f})^2` and the output
:math:`\sum_s p(u_s)\, v_{s,f}` (Rho et al., 2025, Sec. 4.1, in our layout).

:func:`gk_stage` and :func:`softmax_stage` are the program's attention stages
(:mod:`crypto.program.forward`): they fit their operands stage by stage through
the run's policy and keep per head what the backward pass reads;
:func:`gk_attention` and :func:`softmax_attention` evaluate the same formulas on
bare values for the attention benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Value
from .run import Run

QKV = tuple[list[Value], list[list[Value]], list[list[Value]]]
"""Queries, and the keys and values of each shift (rolled copies)."""


def gk_attention(
    ev: Evaluator,
    q: list[Value],
    ks: list[list[Value]],
    vs: list[list[Value]],
    heads: int,
    coefficients: FloatArray,
) -> list[Value]:
    """Gaussian-kernel attention on rolled copies (no normalisation)."""
    d = len(q)
    dh = d // heads
    out: list[Value] = []
    for h in range(heads):
        cols = range(h * dh, (h + 1) * dh)
        weights = []
        for s in range(len(ks)):
            sq = [ev.square(ev.sub(q[f], ks[s][f])) for f in cols]
            weights.append(ev.poly(ev.total(sq), coefficients))
        for f in cols:
            out.append(ev.total([ev.mul(weights[s], vs[s][f]) for s in range(len(vs))]))
    return out


@dataclass(frozen=True)
class SoftmaxPolys:
    r"""Polynomials of the HE softmax baseline.

    ``exp`` approximates :math:`c\,e^{R t}` on :math:`t\in[-1,1]` (scores divided by
    ``R``; the constant ``c`` is chosen so that every row sum
    :math:`\sum_s c\,e^{R t_s}` lies in ``[lo, 1]``, where ``recip`` (plus
    ``newton`` steps :math:`y \leftarrow y(2 - s y)`) inverts it; ``c`` cancels in
    the normalised output).
    """

    exp: FloatArray
    recip: FloatArray
    newton: int = 2


def softmax_attention(
    ev: Evaluator,
    q: list[Value],
    ks: list[list[Value]],
    vs: list[list[Value]],
    heads: int,
    polys: SoftmaxPolys,
) -> list[Value]:
    r"""Polynomial softmax attention (the baseline GK attention replaces).

    ``q`` must already carry the factor :math:`1/(\sqrt{d_h} R)`. Depth:
    1 (scores) + 3 (exp) + 2 (reciprocal) + 2 per Newton step + 1 (normalise):
    11 levels with two Newton steps, against 5 for the Gaussian kernel.
    """
    d = len(q)
    dh = d // heads
    n = len(ks)
    out: list[Value] = []
    for h in range(heads):
        cols = list(range(h * dh, (h + 1) * dh))
        qs = ev.ensure([q[f] for f in cols], 1 + 3, "softmax scores")
        e = []
        for s in range(n):
            score = ev.total([ev.mul(qs[i], ks[s][f]) for i, f in enumerate(cols)])
            e.append(ev.poly(score, polys.exp))
        [total] = ev.ensure([ev.total(e)], 2, "softmax reciprocal")
        y = ev.poly(total, polys.recip)
        for _ in range(polys.newton):
            [total, y] = ev.ensure([total, y], 2, "softmax Newton")
            y = ev.mul(y, ev.shift(ev.neg(ev.mul(total, y)), 2.0))
        e = ev.ensure(e, 1, "softmax weights")
        [y] = ev.ensure([y], 1, "softmax weights")
        for f in cols:
            acc = ev.total([ev.mul(e[s], vs[s][f]) for s in range(n)])
            [acc, yy] = ev.ensure([acc, y], 1, "softmax normalise")
            out.append(ev.mul(acc, yy))
    return out


def heads(d: int, n_heads: int) -> list[list[int]]:
    """The feature columns of each attention head."""
    dh = d // n_heads
    return [list(range(h * dh, (h + 1) * dh)) for h in range(n_heads)]


def gk_stage(r: Run, n_heads: int, qkv: QKV, gk: FloatArray, pre: str) -> list[Value]:
    """Gaussian-kernel attention; keeps per head its differences, distances, weights."""
    q, ks, vs = qkv
    ev, n = r.ev, len(ks)
    q, *ks = r.fit([q, *ks], 1, "kernel distance")
    out: list[Value] = [Value(None)] * len(q)
    for h, cols in enumerate(heads(len(q), n_heads)):
        diff, u, done = [], [], {}
        for s in range(n):  # each kernel as soon as its distance has the levels
            diff.append([ev.sub(q[f], ks[s][f]) for f in cols])
            u.append(ev.total([ev.square(x) for x in diff[s]]))
            if u[s].level + 3 <= ev.max_level:
                done[s] = ev.poly(u[s], gk)
        late = [s for s in range(n) if s not in done]
        if late:  # the others, refreshed in one round trip
            [fresh] = r.fit([[u[s] for s in late]], 3, "kernel")
            for s, x in zip(late, fresh, strict=True):
                u[s], done[s] = x, ev.poly(x, gk)
        kv = [
            [done[s] for s in range(n)],
            *[[vs[s][f] for f in cols] for s in range(n)],
        ]
        w, *vh = r.fit(kv, 1, "kv")
        for i, f in enumerate(cols):
            out[f] = ev.total([ev.mul(w[s], vh[s][i]) for s in range(n)])
        tag = f"{pre}head {h} "
        for s in range(n):
            r.keep(f"{tag}diff {s}", diff[s])
            r.keep(f"{tag}v {s}", vh[s])
        r.keep(f"{tag}u", u)
        r.keep(f"{tag}w", w)
    return out


def softmax_stage(
    r: Run, n_heads: int, qkv: QKV, polys: SoftmaxPolys, pre: str
) -> list[Value]:
    """Polynomial-softmax attention; keeps per head what its backward pass reads."""
    q, ks, vs = qkv
    ev, n = r.ev, len(ks)
    out: list[Value] = [Value(None)] * len(q)
    for h, cols in enumerate(heads(len(q), n_heads)):
        groups = [[q[f] for f in cols], *[[k[f] for f in cols] for k in ks]]
        qh, *kh = r.fit(groups, 1, "softmax scores")
        dots = [
            ev.total([ev.mul(a, c) for a, c in zip(qh, kh[s], strict=True)])
            for s in range(n)
        ]
        [scores] = r.fit([dots], 3, "softmax exp")
        e = [ev.poly(x, polys.exp) for x in scores]
        [[total]] = r.fit([[ev.total(e)]], 2, "softmax reciprocal")
        y = ev.poly(total, polys.recip)
        for _ in range(polys.newton):
            [[total, y]] = r.fit([[total, y]], 2, "softmax Newton")
            y = ev.mul(y, ev.shift(ev.neg(ev.mul(total, y)), 2.0))
        e, *vh = r.fit([e, *[[vs[s][f] for f in cols] for s in range(n)]], 1, "kv")
        acc = [
            ev.total([ev.mul(e[s], vh[s][i]) for s in range(n)])
            for i in range(len(cols))
        ]
        acc, [y] = r.fit([acc, [y]], 1, "softmax normalise")
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
