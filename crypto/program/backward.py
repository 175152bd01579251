r"""One backward pass for every model family: LoRA factors, full matrices, the head.

:func:`train_forward` runs a :class:`~.spec.Program` (HEFormer or converted BERT)
through the one forward program (:func:`crypto.program.forward.forward` with
``trained=k``): the blocks before the last ``k`` under the inference policy, the
last ``k`` and the head under the training policy, keeping their activations in
``Run.trace``. :func:`backward` then
differentiates the squared error
:math:`L = \tfrac1{2B}\sum_b \lVert \ell_b - y_b\rVert^2` on the CLS logits
(:math:`\bar\ell = m\odot(\ell - Y)`, :func:`loss_gradient`, with the public mask
``m``: ``1/B`` on the CLS slots), writing :math:`\bar x` for
:math:`\partial L/\partial x`:

.. math::

    \bar W_c &= \textstyle\sum_t p\,\bar\ell^T, & \bar t &= (\bar\ell W_c^T)\odot
        p_{\tanh}'(t), & \bar W_p &= \textstyle\sum_t o\,\bar t^T, \\
    \bar o &= N_o^*(\bar t W_p^T), & \bar a &= (\bar o W_2^T)\odot\phi'(a), &
        \bar h &= N_a^*\bigl(\bar o + N_f^*(\bar a W_1^T)\bigr),

then :math:`\overline{att} = \bar h W_o^T` through the attention
(:mod:`crypto.program.layer_grad`); the rolled gradients :math:`\bar k_s,
M_s\odot\bar v_s` are rolled back and summed by the key owner (``unroll``, a
counted round trip: the layout stays rotation-free). LoRA factors get
:math:`\bar A = \sum_t z\,(\bar x' B^T)^T`, :math:`\bar B = \sum_t (zA)\,\bar x'^T`,
encrypted full matrices :math:`\bar W = \sum_t x\,\bar y^T` (slot sums); between two
trained blocks the input's gradient is the residual's plus
:math:`\bar x' W_x^T + (\bar x' B_x^T) A_x^T` for each of Q, K, V. Every stage is a
slot-wise :class:`~crypto.he.evaluator.Evaluator` operation that first fits its
operands into the chain, so the same pass runs on NumpyBackend and on CKKS, and the
public schedule is a function of the program, the trained set and the chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Value
from .attention import SoftmaxPolys
from .blocks import Matrix, matmul_t, outer_sums, weight
from .forward import forward
from .layer_grad import (
    attention_backward,
    derivative,
    fused_norm_backward,
    norm_backward,
)
from .run import Run, Trace, fit
from .spec import Block, Program, depth

Unroll = Callable[[list[list[Value]]], list[Value]]
Grads = dict[str, list[list[Value]]]

DENSE_STAGE = {
    "heformer": {
        "pool": "pool grad",
        "w2": "w2 grad",
        "w1": "w1 grad",
        "wo": "wo grad",
    },
    "bert": {
        "pool": "pooler grad",
        "w2": "feed-forward grad",
        "w1": "feed-forward input grad",
        "wo": "output projection grad",
    },
}
"""Each family's names for the refresh before a transpose product (public schedule)."""


@dataclass(frozen=True)
class Trained:
    """What a step trains: the last ``blocks`` blocks and their encrypted matrices.

    Which matrices are the client's is read from ``Run.lora``: in each trained
    block the LoRA factors of Q, K, V (``f"{prefix}q_a"`` ...) and any full
    matrix present (``f"{prefix}wq"`` ... ``"w2"``), and the head's ``"pool"``,
    ``"classifier"`` when present. ``softmax`` selects the polynomial-softmax
    attention (the HEFormer's baseline arm) instead of the Gaussian kernel.
    """

    blocks: int = 1
    softmax: SoftmaxPolys | None = None

    def __post_init__(self) -> None:
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int):
            raise TypeError(f"Trained.blocks must be an int, got {self.blocks!r}")
        if self.blocks < 1:
            raise ValueError(f"Trained.blocks must be >= 1, got {self.blocks}")

    def first(self, p: Program) -> int:
        """Index of the first trained block (a clear error beyond the program)."""
        if self.blocks > len(p.blocks):
            raise ValueError(
                f"trained blocks: expected 1 to {len(p.blocks)} blocks, got "
                f"{self.blocks}"
            )
        return len(p.blocks) - self.blocks


def train_forward(r: Run, p: Program, z: list[Value], t: Trained) -> list[Value]:
    """Logits on every slot; the trained blocks and the head fill ``r.trace``."""
    if r.trace is None:
        r.trace = {}
    if r.roll is None:
        raise ValueError("a training step needs the key owner's roll (interactive)")
    t.first(p)  # a clear error for more trained blocks than the program has
    return forward(r, p, z, t.blocks, t.softmax)


def loss_gradient(
    ev: Evaluator, logits: list[Value], Y: list[Value], m: FloatArray
) -> list[Value]:
    r""":math:`\bar\ell = m\odot(\ell - Y)` (one fit, one masked product)."""
    [logits] = fit(ev, [logits], 1, "loss")
    return [ev.mask(ev.sub(lg, y), m) for lg, y in zip(logits, Y, strict=True)]


def _dense(
    ev: Evaluator,
    grads: Grads,
    key: str,
    W: Matrix,
    inputs: list[Value],
    dout: list[Value],
    stage: str,
) -> tuple[list[Value], list[Value]]:
    """(fitted ``dout``, ``dout W^T``); records W's gradient sums if it is secret."""
    if isinstance(W, list):
        x, dout = fit(ev, [inputs, dout], 1, stage)
        grads[key] = outer_sums(ev, x, dout)
    else:
        [dout] = fit(ev, [dout], 1, stage)
    return dout, matmul_t(ev, dout, W)


def _poly_grad(
    ev: Evaluator, pre: list[Value], poly: FloatArray, dout: list[Value], stage: str
) -> list[Value]:
    """Back through ``poly`` applied slot-wise to ``pre`` (the chain rule)."""
    coefficients = derivative(poly)
    [pre] = fit(ev, [pre], depth(coefficients), f"{stage} derivative")
    slope = [ev.poly(x, coefficients) for x in pre]
    dout, slope = fit(ev, [dout, slope], 1, f"{stage} grad")
    return [ev.mul(a, b) for a, b in zip(dout, slope, strict=True)]


def _block_backward(
    r: Run,
    p: Program,
    b: Block,
    dz: list[Value],
    unroll: Unroll,
    grads: Grads,
    t: Trained,
    want_input: bool,
) -> list[Value] | None:
    """Block ``b``'s gradient sums into ``grads``; its input's gradient if wanted."""
    ev, pre, d, n, tr = r.ev, b.prefix, p.d, p.n_tokens, r.trace
    assert tr is not None
    names = DENSE_STAGE.get(p.family, DENSE_STAGE["bert"])
    bert_names = p.family != "heformer"
    dout = dz
    if b.output_norm is not None:
        dout = norm_backward(ev, b.output_norm, tr, dout)
    w2, w1, wo = (weight(r, b, x) for x in ("w2", "w1", "o"))
    fitted, dhid = _dense(
        ev, grads, f"{pre}w2", w2, tr[f"{pre}hidden"], dout, f"{pre}{names['w2']}"
    )
    if bert_names:  # the converted BERT's residual carries the refreshed gradient
        dout = fitted
    da = _poly_grad(ev, tr[f"{pre}pre-activation"], b.act, dhid, f"{pre}activation")
    _, du = _dense(
        ev, grads, f"{pre}w1", w1, tr[f"{pre}normed"], da, f"{pre}{names['w1']}"
    )
    if b.ffn_norm is not None:
        dh = fused_norm_backward(ev, b.ffn_norm, tr, du, dout)
    else:
        dh = [ev.add(x, y) for x, y in zip(dout, du, strict=True)]
    if b.attention_norm is not None:
        dh = norm_backward(ev, b.attention_norm, tr, dh)
    fitted, datt = _dense(
        ev, grads, f"{pre}wo", wo, tr[f"{pre}attended"], dh, f"{pre}{names['wo']}"
    )
    dz_in = fitted if want_input else None
    dq, dks, dvs = attention_backward(ev, p, b, tr, datt, t.softmax)
    if r.masks is not None:
        for s in range(n):
            vals, [mk] = fit(ev, [dvs[s], [r.masks[s]]], 1, f"{pre}key weights grad")
            dvs[s] = [ev.mul(x, mk) for x in vals]
    back = unroll([dks[s] + dvs[s] for s in range(n)])
    ev.note("unroll_rounds")
    z = tr[f"{pre}input"]
    for name, dx in (("q", dq), ("k", back[:d]), ("v", back[d:])):
        full = r.lora.get(f"{pre}w{name}")
        if full is not None:
            zz, dx = fit(ev, [z, dx], 1, f"{pre}weight grad")
            grads[f"{pre}w{name}"] = outer_sums(ev, zz, dx)
        A = r.lora.get(f"{pre}{name}_a")
        if A is not None:
            B = r.lora[f"{pre}{name}_b"]
            [dx] = fit(ev, [dx], 1, f"{pre}LoRA grad")
            zz, gb = fit(ev, [z, matmul_t(ev, dx, B)], 1, f"{pre}LoRA A grad")
            grads[f"{pre}{name}_a"] = outer_sums(ev, zz, gb)
            low, dx = fit(ev, [tr[f"{pre}{name} low"], dx], 1, f"{pre}LoRA B grad")
            grads[f"{pre}{name}_b"] = outer_sums(ev, low, dx)
        if dz_in is not None:
            W = weight(r, b, name)
            if A is None:
                part = matmul_t(ev, dx, W)
            else:
                [gb] = fit(ev, [gb], 1, f"{pre}input grad")
                part = [
                    ev.add(x, y)
                    for x, y in zip(
                        matmul_t(ev, dx, W), matmul_t(ev, gb, A), strict=True
                    )
                ]
            dz_in = [ev.add(x, y) for x, y in zip(dz_in, part, strict=True)]
    return dz_in


def trained_keys(r: Run, p: Program, t: Trained) -> list[str]:
    """The gradient keys a step returns, in the order the client reads them."""
    keys = []
    for b in p.blocks[t.first(p) :]:
        pre = b.prefix
        for x in "qkv":
            keys += [f"{pre}{x}_{f}" for f in "ab" if f"{pre}{x}_{f}" in r.lora]
        full = ("wq", "wk", "wv", "wo", "w1", "w2")
        keys += [f"{pre}{w}" for w in full if f"{pre}{w}" in r.lora]
    return keys + [k for k in ("pool", "classifier") if k in r.lora]


def backward(
    r: Run, p: Program, dlogits: list[Value], unroll: Unroll, t: Trained
) -> Grads:
    """Encrypted gradient sums (replicated over the slots) of every secret matrix.

    ``r`` is the run :func:`train_forward` filled; ``dlogits`` the loss gradient
    (:func:`loss_gradient`); ``unroll`` the key owner's roll-back and sum of the
    rolled K/V gradients. Keys as in :func:`trained_keys`.
    """
    ev, hd, tr = r.ev, p.head, r.trace
    if tr is None or "pooled" not in tr:
        raise ValueError("run train_forward with this Run first (its trace is empty)")
    grads: Grads = {}
    classifier: Matrix = r.lora.get("classifier", hd.classifier.weight)
    _, dpooled = _dense(
        ev, grads, "classifier", classifier, tr["pooled"], dlogits, "classifier grad"
    )
    dt = _poly_grad(ev, tr["pre-tanh"], hd.tanh, dpooled, "tanh")
    names = DENSE_STAGE.get(p.family, DENSE_STAGE["bert"])
    pool: Matrix = r.lora.get("pool", hd.pool.weight)
    _, dz = _dense(ev, grads, "pool", pool, tr["head input"], dt, names["pool"])
    first = t.first(p)
    for i in range(len(p.blocks) - 1, first - 1, -1):
        found = _block_backward(r, p, p.blocks[i], dz, unroll, grads, t, i > first)
        if found is not None:
            dz = found
    return {k: grads[k] for k in trained_keys(r, p, t)}


def adapter_gradients(
    ev: Evaluator,
    p: Program,
    pooled: list[Value],
    A: list[list[Value]],
    B: list[list[Value]],
    Y: list[Value],
    m: FloatArray,
) -> tuple[Grads, list[Value]]:
    r"""The classifier adapter's gradient sums on the pooler's output, and the logits.

    :math:`\ell = p W_c + (pA)B + b_c`, :math:`G = m\odot(\ell - Y)`,
    :math:`\bar B_{rc} = \sum_t (pA)_r G_c`, :math:`\bar A_{gr} = \sum_t p_g
    (GB^T)_r`: keys ``"a"``, ``"b"``.
    """
    rank, hd = len(B), p.head
    pooled = ev.ensure(pooled, 2, "head LoRA forward")
    low = [
        ev.total([ev.mul(x, A[g][j]) for g, x in enumerate(pooled)])
        for j in range(rank)
    ]
    base = ev.linear(pooled, hd.classifier.weight)
    if hd.classifier.bias is not None:
        base = [
            ev.shift(y, float(c)) for y, c in zip(base, hd.classifier.bias, strict=True)
        ]
    logits = [
        ev.add(base[c], ev.total([ev.mul(low[j], B[j][c]) for j in range(rank)]))
        for c in range(len(base))
    ]
    diff = [ev.sub(a, y) for a, y in zip(logits, Y, strict=True)]
    flat = ev.ensure(diff + low + pooled, 3, "head LoRA gradients")
    C = len(diff)
    G = [ev.mask(x, m) for x in flat[:C]]
    low, pooled = flat[C : C + rank], flat[C + rank :]
    grad_b = [[ev.slot_sum(ev.mul(low[j], g)) for g in G] for j in range(rank)]
    gb = [ev.total([ev.mul(G[c], B[j][c]) for c in range(C)]) for j in range(rank)]
    grad_a = [[ev.slot_sum(ev.mul(x, gb[j])) for j in range(rank)] for x in pooled]
    return {"a": grad_a, "b": grad_b}, logits


__all__ = [
    "Trace",
    "Trained",
    "adapter_gradients",
    "backward",
    "loss_gradient",
    "train_forward",
    "trained_keys",
]
