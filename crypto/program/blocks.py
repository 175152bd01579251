r"""The program's layers on packed values: affine maps, LayerNorm, polynomial maps.

Each function takes values of :class:`~crypto.he.evaluator.Evaluator` and asks for
the refreshes its stage needs (``ev.ensure``) under the stage names it is given, so
the public schedule is a function of the spec alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Value
from .spec import Affine, Norm, depth


def affine(
    ev: Evaluator, xs: Sequence[Value], W: FloatArray, b: FloatArray | None
) -> list[Value]:
    r""":math:`y_f = \sum_g x_g W_{gf} + b_f` (public W and b; one level).

    ``b`` ``None`` adds nothing (no plaintext add at all).
    """
    ys = ev.linear(xs, W)
    if b is None:
        return ys
    return [ev.shift(y, float(c)) for y, c in zip(ys, b, strict=True)]


def project(
    ev: Evaluator,
    xs: Sequence[Value],
    lin: Affine,
    secret: Sequence[Sequence[Value]] | None = None,
) -> list[Value]:
    r"""An affine map whose matrix is public, or the client's encrypted one.

    With ``secret`` (an encrypted ``(in, out)`` matrix, one value per entry),
    :math:`y_f = \sum_g x_g S_{gf}` by ciphertext products (one level) replaces
    the public ``lin.weight``; ``lin.bias`` is added either way.
    """
    if secret is None:
        return affine(ev, xs, lin.weight, lin.bias)
    ys = [
        ev.total([ev.mul(xs[g], secret[g][f]) for g in range(len(xs))])
        for f in range(len(secret[0]))
    ]
    if lin.bias is None:
        return ys
    return [ev.shift(y, float(c)) for y, c in zip(ys, lin.bias, strict=True)]


def layer_norm(ev: Evaluator, x: list[Value], w: Norm) -> list[Value]:
    r"""The polynomial LayerNorm of :class:`~crypto.program.spec.Norm`.

    :math:`\sigma = \sum_f (xS)_f^2`, :math:`y = p(\sigma)` refined by
    :math:`y \leftarrow y(c - \sigma y^2)`, output :math:`(xO)_f\,y + \beta_f`.
    Refresh stages: ``"{stage} statistics"``, ``"inverse sqrt"``, ``"Newton"``,
    ``"scale"``.
    """
    stage = w.stage
    x = ev.ensure(x, 2, f"{stage} statistics")
    centred = ev.linear(x, w.stats)
    scaled = centred if w.out is None else ev.linear(x, w.out)
    sigma = ev.total([ev.square(c) for c in centred])
    [sigma] = ev.ensure([sigma], depth(w.isqrt), f"{stage} inverse sqrt")
    y = ev.poly(sigma, w.isqrt)
    for _ in range(w.newton):
        sigma, y = ev.ensure([sigma, y], 3, f"{stage} Newton")
        y = ev.mul(y, ev.shift(ev.neg(ev.mul(sigma, ev.square(y))), w.newton_shift))
    both = ev.ensure([*scaled, y], 1, f"{stage} scale")
    out = [ev.mul(s, both[-1]) for s in both[:-1]]
    if w.beta is None:
        return out
    return [ev.shift(o, float(b)) for o, b in zip(out, w.beta, strict=True)]


def mapped(
    ev: Evaluator,
    x: list[Value],
    lin: Affine,
    coefficients: FloatArray,
    stage: str,
    secret: Sequence[Sequence[Value]] | None = None,
) -> list[Value]:
    """``p(x W + b)``, refreshing ``x`` once if the chain allows, else in two steps.

    One refresh leaves room for the polynomial and the next linear map
    (``1 + depth(p) + 1`` levels); on a shorter chain the pre-activation is
    refreshed again (``"{stage} polynomial"``).
    """
    need = 1 + depth(coefficients)
    if need + 1 <= ev.max_level:  # room for the next linear map too
        x = ev.ensure(x, need + 1, stage)
        return [ev.poly(t, coefficients) for t in project(ev, x, lin, secret)]
    x = ev.ensure(x, 1, stage)
    pre = project(ev, x, lin, secret)
    pre = ev.ensure(pre, depth(coefficients), f"{stage} polynomial")
    return [ev.poly(t, coefficients) for t in pre]


def residual(ev: Evaluator, a: Sequence[Value], b: Sequence[Value]) -> list[Value]:
    """Slot-wise ``a + b`` of two feature lists (a residual connection)."""
    return [ev.add(x, y) for x, y in zip(a, b, strict=True)]
