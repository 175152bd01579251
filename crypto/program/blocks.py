r"""The program's layers on packed values: affine maps, LayerNorm, polynomial maps.

Each layer asks :meth:`~crypto.program.run.Run.fit` for the levels its stage needs
under the stage names it is given (the run's policy groups and answers the
requests), so the public schedule is a function of the spec, the policy and the
chain. A matrix is public (an array) or the client's encrypted one (one value per
entry, :data:`Matrix`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Value
from .run import Run
from .spec import Affine, Block, Norm, depth

Matrix = FloatArray | list[list[Value]]
"""A public array, or the client's encrypted matrix (one value per entry)."""


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


def dense(
    ev: Evaluator, xs: Sequence[Value], W: Matrix, bias: FloatArray | None
) -> list[Value]:
    """``xs W + b`` (public or encrypted W; ``b`` None adds nothing)."""
    ys = matmul(ev, xs, W)
    if bias is None:
        return ys
    return [ev.shift(y, float(c)) for y, c in zip(ys, bias, strict=True)]


def weight(r: Run, b: Block, name: str) -> Matrix:
    """Block matrix ``name`` (``q k v o w1 w2``): the client's, else the public one."""
    key = f"{b.prefix}{name if name[0] == 'w' else 'w' + name}"
    secret = r.lora.get(key)
    if secret is not None:
        return secret
    lin = getattr(b, name)
    return np.asarray(lin.weight)


def affine(
    ev: Evaluator, xs: Sequence[Value], W: FloatArray, b: FloatArray | None
) -> list[Value]:
    r""":math:`y_f = \sum_g x_g W_{gf} + b_f` (public W and b; one level).

    ``b`` ``None`` adds nothing (no plaintext add at all).
    """
    return dense(ev, xs, W, b)


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
    W: Matrix = lin.weight if secret is None else [list(row) for row in secret]
    return dense(ev, xs, W, lin.bias)


def norm(r: Run, x: list[Value], w: Norm) -> tuple[list[Value], list[Value]]:
    r"""(The polynomial LayerNorm of ``x``, ``x`` as refreshed for its statistics).

    :math:`\sigma = \sum_f (xS)_f^2`, :math:`y = p(\sigma)` refined by
    :math:`y \leftarrow y(c - \sigma y^2)`, output :math:`(xO)_f\,y + \beta_f`.
    Refresh stages: ``"{stage} statistics"``, ``"inverse sqrt"``, ``"Newton"``,
    ``"scale"``. Keeps (under ``w.stage``) :math:`\hat x = xO`, the centred
    :math:`xS`, :math:`\sigma`, each Newton step's fitted :math:`\sigma` and
    :math:`y_0, \ldots, y_K` for the backward pass.
    """
    ev, st = r.ev, w.stage
    [x] = r.fit([x], 2, f"{st} statistics")
    centred = ev.linear(x, w.stats)
    scaled = centred if w.out is None else ev.linear(x, w.out)
    sigma = ev.total([ev.square(c) for c in centred])
    [[sigma]] = r.fit([[sigma]], depth(w.isqrt), f"{st} inverse sqrt")
    ys, s = [ev.poly(sigma, w.isqrt)], sigma
    for k in range(w.newton):
        held = sigma if r.policy.newton_refits else s
        [[s, y]] = r.fit([[held, ys[-1]]], 3, f"{st} Newton")
        ys[-1] = y
        r.keep(f"{st} sigma {k}", [s])
        ys.append(ev.mul(y, ev.shift(ev.neg(ev.mul(s, ev.square(y))), w.newton_shift)))
    scaled, [y] = r.fit([scaled, [ys[-1]]], 1, f"{st} scale")
    out = [ev.mul(c, y) for c in scaled]
    if w.beta is not None:
        out = [ev.shift(o, float(c)) for o, c in zip(out, w.beta, strict=True)]
    r.keep(f"{st} scaled", scaled)
    r.keep(f"{st} centred", scaled if w.out is None else centred)
    r.keep(f"{st} sigma", [sigma])
    r.keep(f"{st} ys", ys)
    r.keep(f"{st} y", [y])
    return out, x


def layer_norm(ev: Evaluator, x: list[Value], w: Norm) -> list[Value]:
    """The polynomial LayerNorm of :func:`norm` under the inference policy."""
    return norm(Run(ev, {}), x, w)[0]


def polymap(
    r: Run,
    x: list[Value],
    lin: tuple[Matrix, FloatArray | None],
    coefficients: FloatArray,
    stages: tuple[str, str],
) -> tuple[list[Value], list[Value], list[Value]]:
    r"""(``x`` as refreshed, :math:`a = xW + b` as refreshed, :math:`p(a)`).

    ``stages``: the refresh of ``x`` and, as a template of the policy
    (:class:`~crypto.program.run.Policy`), the one before the polynomial. A fused
    policy refreshes ``x`` once for the map, the polynomial and the next linear map
    (``1 + depth(p) + 1`` levels) when the chain allows.
    """
    need = 1 + depth(coefficients)
    fused = r.policy.fused and need + 1 <= r.ev.max_level
    [x] = r.fit([x], need + 1 if fused else 1, stages[0])
    [a] = r.fit([dense(r.ev, x, *lin)], depth(coefficients), stages[1])
    return x, a, [r.ev.poly(t, coefficients) for t in a]


def mapped(
    ev: Evaluator,
    x: list[Value],
    lin: Affine,
    coefficients: FloatArray,
    stage: str,
    secret: Sequence[Sequence[Value]] | None = None,
) -> list[Value]:
    """``p(x W + b)`` under the inference policy (:func:`polymap`).

    One refresh leaves room for the polynomial and the next linear map
    (``1 + depth(p) + 1`` levels); on a shorter chain the pre-activation is
    refreshed again (``"{stage} polynomial"``).
    """
    W: Matrix = lin.weight if secret is None else [list(row) for row in secret]
    stages = (stage, f"{stage} polynomial")
    return polymap(Run(ev, {}), x, (W, lin.bias), coefficients, stages)[2]


def residual(ev: Evaluator, a: Sequence[Value], b: Sequence[Value]) -> list[Value]:
    """Slot-wise ``a + b`` of two feature lists (a residual connection)."""
    return [ev.add(x, y) for x, y in zip(a, b, strict=True)]
