r"""The packed network of one fine-tuning arm and its dense primitives.

:class:`Net` holds the arm's matrices, plaintext (frozen, public) or one encrypted
replicated value per entry (trained). The primitives are the products the forward
and backward passes of :mod:`crypto.program.backprop` are made of: :func:`matmul`
(:math:`y_f = \sum_g x_g W_{gf}`), its transpose, the slot-summed outer products of
the weight gradients, and :func:`fit`, which refreshes (client-aided, counted) the
operands that would overrun the modulus chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Value
from .heformer import SoftmaxPolys

Matrix = FloatArray | list[list[Value]]
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


def heads_of(net: Net, d: int) -> list[list[int]]:
    """The feature columns of each attention head."""
    dh = d // net.heads
    return [list(range(h * dh, (h + 1) * dh)) for h in range(net.heads)]
