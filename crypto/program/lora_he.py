r"""Encrypted LoRA versus encrypted full weights for one linear layer, and SGD steps.

Why LoRA helps under HE (Rho et al., 2025, Sec. 4.2): with full fine-tuning every
trained weight becomes a ciphertext, so the forward :math:`X W` costs :math:`d^2`
ciphertext-ciphertext products and the weight gradient :math:`X^T G` costs
:math:`d^2` products plus :math:`d^2` slot sums (rotations). With LoRA,
:math:`W_0` stays plaintext (:math:`d^2` cheap plaintext products), and only
:math:`X A` and :math:`(X A) B` (:math:`2 d r` products) and the gradients

.. math::

    \nabla_B = (X A)^T G, \qquad \nabla_A = X^T (G B^T)

(:math:`3 d r` products and :math:`2 d r` sums) touch ciphertexts.

Layout: ``X`` is feature-major (one ciphertext per input feature, one slot per
token); each encrypted weight entry is a ciphertext replicated over the slots.
The loss of the SGD demonstration is the mean squared error
:math:`\tfrac1{2T}\lVert X(W_0 + AB) - Y\rVert^2` over ``T`` tokens with encrypted
targets ``Y`` (MSE keeps the step free of the softmax polynomial); the server
computes the encrypted sums with :math:`G = X(W_0+AB) - Y` and the :math:`1/T`
joins the learning rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from defenses.arrays import FloatArray


@dataclass
class Timer:
    """Accumulated seconds per named step."""

    seconds: dict[str, float]

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        """Time ``fn()`` under ``name``."""
        start = time.perf_counter()
        out = fn()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return out


def _enc(ctx: Any, values: FloatArray) -> Any:
    import tenseal as ts

    return ts.ckks_vector(ctx, list(np.asarray(values, dtype=np.float64)))


def _lincomb(terms: list[Any]) -> Any:
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out


def full_forward(x: list[Any], W: list[list[Any]]) -> list[Any]:
    r""":math:`y_f = \sum_g x_g W_{gf}` with every weight encrypted."""
    return [_lincomb([x[g] * W[g][f] for g in range(len(x))]) for f in range(len(W[0]))]


def lora_forward(
    x: list[Any], W0: FloatArray, A: list[list[Any]], B: list[list[Any]]
) -> tuple[list[Any], list[Any]]:
    """:math:`y = x W_0 + (x A) B`; returns (y, x A)."""
    d_out = W0.shape[1]
    xa = [_lincomb([x[g] * A[g][r] for g in range(len(x))]) for r in range(len(B))]
    y = [
        _lincomb(
            [x[g] * float(W0[g, f]) for g in range(len(x))]
            + [xa[r] * B[r][f] for r in range(len(B))]
        )
        for f in range(d_out)
    ]
    return y, xa


def full_gradient(
    x: list[Any], grad: list[Any], entries: list[tuple[int, int]]
) -> list[Any]:
    r""":math:`\nabla W_{gf} = \sum_t x_g[t] G_f[t]` for the listed entries."""
    return [(x[g] * grad[f]).sum() for g, f in entries]


def lora_gradient(
    x: list[Any], xa: list[Any], grad: list[Any], B: list[list[Any]]
) -> tuple[list[list[Any]], list[list[Any]]]:
    r""":math:`\nabla_A = X^T (G B^T)`, :math:`\nabla_B = (XA)^T G` (encrypted sums)."""
    rank, d_out = len(B), len(B[0])
    gb = [_lincomb([grad[f] * B[r][f] for f in range(d_out)]) for r in range(rank)]
    grad_a = [[(x[g] * gb[r]).sum() for r in range(rank)] for g in range(len(x))]
    grad_b = [[(xa[r] * grad[f]).sum() for f in range(d_out)] for r in range(rank)]
    return grad_a, grad_b


def simulate_step(
    X: FloatArray,
    Y: FloatArray,
    W0: FloatArray,
    A: FloatArray,
    B: FloatArray,
    lr: float,
) -> tuple[FloatArray, FloatArray]:
    """One plaintext SGD step of the LoRA factors on the mean squared error."""
    G = (X @ (W0 + A @ B) - Y) / X.shape[0]
    grad_a = X.T @ (G @ B.T)
    grad_b = (X @ A).T @ G
    return A - lr * grad_a, B - lr * grad_b


def encrypted_steps(
    ctx: Any,
    X: FloatArray,
    Y: FloatArray,
    W0: FloatArray,
    A: FloatArray,
    B: FloatArray,
    lr: float,
    steps: int,
) -> tuple[FloatArray, FloatArray, int]:
    r"""``steps`` SGD steps with encrypted gradients; returns (A, B, refreshes).

    The server computes :math:`\nabla_A, \nabla_B` under encryption; the slot sums
    leave one-slot ciphertexts, so the key owner applies
    :math:`A \leftarrow A - \eta\nabla_A` while refreshing them back into
    replicated weights for the next step (one counted round trip per step, the
    stand-in for the bootstrap a server-side update would need).
    """
    if X.shape[0] & (X.shape[0] - 1):
        raise ValueError(f"the token count must be a power of two, got {X.shape[0]}")
    slots = X.shape[0]
    x = [_enc(ctx, X[:, g]) for g in range(X.shape[1])]
    y = [_enc(ctx, Y[:, f]) for f in range(Y.shape[1])]
    refreshes = 0
    for _ in range(steps):
        Ae = [[_enc(ctx, np.full(slots, v)) for v in row] for row in A]
        Be = [[_enc(ctx, np.full(slots, v)) for v in row] for row in B]
        out, xa = lora_forward(x, W0, Ae, Be)
        grad = [o - t for o, t in zip(out, y, strict=True)]
        grad_a, grad_b = lora_gradient(x, xa, grad, Be)
        step = lr / slots
        A = A - step * np.array([[v.decrypt()[0] for v in row] for row in grad_a])
        B = B - step * np.array([[v.decrypt()[0] for v in row] for row in grad_b])
        refreshes += 1
    return A, B, refreshes
