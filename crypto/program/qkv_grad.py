r"""Backpropagation of the converted BERT's blocks to their Q/K/V LoRA factors.

The program of :func:`crypto.program.encoder.encode` with the trained blocks' forward
passes keeping what their backward passes read, then the backward pass from the
loss to the LoRA factors :math:`A_x, B_x` (:math:`x \in \{q, k, v\}`) of the last
``trained`` blocks; the earlier blocks run frozen (:func:`frozen_block`, the
forward pass only). Between two trained blocks the gradient of a block's input is
the residual's plus :math:`\bar x' W_x^T + (\bar x' B_x^T) A_x^T` for each of
Q, K, V (the rolled keys' and values' gradients rolled back first).
Every stage is a slot-wise operation of the level-tracking
:class:`~crypto.he.evaluator.Evaluator`, so the same program runs on NumpyBackend
(float64) and on CKKS ciphertexts. Writing :math:`\bar x` for
:math:`\partial L/\partial x`, with :math:`L = \tfrac1{2B}\sum_b \lVert\ell_b -
y_b\rVert^2` on the CLS logits and the public mask ``m`` (``1/B`` on the CLS slots
of the batch's first copy):

.. math::

    \bar\ell &= m\odot(\ell - Y), & \bar p &= \bar\ell W_c^T, &
        \bar t &= \bar p \odot p_{\tanh}'(t), & \bar z_2 &= \bar t W_p^T,\\
    \bar h &= \bar o + \big((\bar o W_2^T)\odot p_{act}'(a)\big) W_1^T, &
        \bar o &= \mathrm{LN}_2^*(\bar z_2), &
        \bar{att} &= \mathrm{LN}_1^*(\bar h) W_o^T.

The polynomial LayerNorm :math:`o_f = \hat x_f\, y + \beta_f` (:math:`\hat x = x S_o`,
:math:`c = x S_c`, :math:`\sigma = \sum_f c_f^2`, :math:`y_0 = P(\sigma)`,
:math:`y_{k+1} = y_k(3/2 - \sigma y_k^2)`; the folded form of
:func:`crypto.program.encoder.layer_norm`) is differentiated as evaluated
(:math:`\mathrm{LN}^*`):

.. math::

    \bar{\hat x} = \bar o\, y, \quad \bar y_K = \textstyle\sum_f \bar o_f \hat x_f,
    \quad \bar y_k = \bar y_{k+1}(3/2 - 3\sigma y_k^2), \quad
    \bar\sigma = \textstyle\sum_k -\bar y_{k+1} y_k^3 + \bar y_0 P'(\sigma),\\
    \bar x = \bar{\hat x} S_o^T + 2\bar\sigma\, c\, S_c^T.

The Gaussian-kernel attention's backward pass is
:func:`crypto.program.attention_grad.gk_backward` on the masked rolled values
:math:`M_s v_s`, so :math:`\bar v_s = M_s \odot \overline{(M_s v_s)}`; the key owner
rolls :math:`\bar k_s, \bar v_s` back and sums them (a counted round trip). With
:math:`x' = z W_x + b_x + (z A_x) B_x`:
:math:`\bar B_{x,rf} = \sum_t (z A_x)_r \bar x'_f` and
:math:`\bar A_{x,gr} = \sum_t z_g (\bar x' B_x^T)_r` (slot sums). The factors are
in the folded form of :func:`crypto.program.encoder.lora_factors` (:math:`\kappa` in
:math:`A_q, A_k`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Roll, Value
from .attention_grad import gk_backward, gk_forward
from .backprop import Unroll
from .encoder import (
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
from .net import Net, derivative, fit, matmul, matmul_t, outer_sums


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
