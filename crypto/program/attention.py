r"""Attention on rolled copies: the Gaussian kernel and the polynomial-softmax baseline.

Copy ``s`` of K and V holds token ``(i + s) mod n`` in slot ``i`` (the rotation-free
layout of :mod:`crypto.he.packing`), so the scores of shift ``s`` are slot-wise: the
Gaussian kernel's :math:`u_s = \sum_{f\in h}(q_f - k_{s,f})^2` and the output
:math:`\sum_s p(u_s)\, v_{s,f}` (Rho et al., 2025, Sec. 4.1, in our layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Value


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
