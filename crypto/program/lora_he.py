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

The layer is the program's own arithmetic, not a copy: values are
:class:`~crypto.he.evaluator.Value` s of the level-tracking
:class:`~crypto.he.evaluator.Evaluator` (on
:class:`~crypto.he.ckks.TenSEALBackend` ciphertexts, or float64 arrays), in the
feature-major layout of :mod:`crypto.he.packing` (one value per input feature,
one slot per token; each encrypted weight entry a value replicated over the slots,
:func:`~crypto.he.packing.unit`), and the products are those of a block's Q/K/V
LoRA in the training pass: :func:`~crypto.program.blocks.matmul` (public or
encrypted matrix), :func:`~crypto.program.blocks.matmul_t` and
:func:`~crypto.program.blocks.outer_sums` (the backward pass's LoRA gradients).

The loss of the SGD demonstration is the mean squared error
:math:`\tfrac1{2T}\lVert X(W_0 + AB) - Y\rVert^2` over ``T`` tokens with encrypted
targets ``Y`` (MSE keeps the step free of the softmax polynomial); the server
computes the encrypted sums with :math:`G = X(W_0+AB) - Y` and the :math:`1/T`
joins the learning rate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from defenses.arrays import FloatArray

from ..he.ckks import CKKSParams, TenSEALBackend, local_key_owner
from ..he.evaluator import Evaluator, Value
from ..he.packing import unit
from .blocks import matmul, matmul_t, outer_sums, residual

Secret = list[list[Value]]
"""An encrypted matrix, one value (replicated over the slots) per entry."""


def encrypted_factors(
    ev: Evaluator, encrypt: Callable[[float], object], A: FloatArray, B: FloatArray
) -> tuple[Secret, Secret]:
    """The client's factors, one replicated value per entry, each at its level.

    A weight is encrypted at the level of the value it first meets: ``A`` meets
    ``x`` at level 0, ``B`` meets ``x A`` at level 1. TenSEAL encrypts at the top
    of the chain only, so one product by 1.0
    (:meth:`~crypto.he.evaluator.Evaluator.scale`) stands in for encoding ``B``
    one level down; it is part of the encryption, not of the layer's arithmetic.
    (Left at level 0, ``B`` would make every product that meets it, and the slot
    sums after them, one prime wider than needed.)
    """
    Ae = unit(encrypt, A)
    Be = [[ev.scale(v, 1.0) for v in row] for row in unit(encrypt, B)]
    return Ae, Be


def full_forward(ev: Evaluator, x: Sequence[Value], W: Secret) -> list[Value]:
    r""":math:`y_f = \sum_g x_g W_{gf}` with every weight encrypted."""
    return matmul(ev, x, W)


def lora_forward(
    ev: Evaluator, x: Sequence[Value], W0: FloatArray, A: Secret, B: Secret
) -> tuple[list[Value], list[Value]]:
    """:math:`y = x W_0 + (x A) B` (public ``W0``); returns (y, x A)."""
    xa = matmul(ev, x, A)
    return residual(ev, matmul(ev, x, W0), matmul(ev, xa, B)), xa


def full_gradient(
    ev: Evaluator,
    x: Sequence[Value],
    grad: Sequence[Value],
    entries: Sequence[tuple[int, int]],
) -> list[Value]:
    r""":math:`\nabla W_{gf} = \sum_t x_g[t] G_f[t]` for the listed entries.

    Each entry is one cell of :func:`~crypto.program.blocks.outer_sums` (one
    product and one slot sum).
    """
    return [ev.slot_sum(ev.mul(x[g], grad[f])) for g, f in entries]


def lora_gradient(
    ev: Evaluator,
    x: Sequence[Value],
    xa: Sequence[Value],
    grad: Sequence[Value],
    B: Secret,
) -> tuple[Secret, Secret]:
    r""":math:`\nabla_A = X^T (G B^T)`, :math:`\nabla_B = (XA)^T G` (encrypted sums)."""
    return outer_sums(ev, x, matmul_t(ev, grad, B)), outer_sums(ev, xa, grad)


@dataclass(frozen=True)
class Regression:
    r"""The SGD demonstration's layer: inputs, targets and the frozen weight.

    ``X`` and ``Y`` are ``T x d`` (``T`` tokens), ``W0`` the public ``d x d``; the
    loss of factors ``A``, ``B`` is
    :math:`\tfrac1{2T}\lVert X(W_0 + AB) - Y\rVert^2`.
    """

    X: FloatArray
    Y: FloatArray
    W0: FloatArray

    def step(
        self, A: FloatArray, B: FloatArray, lr: float
    ) -> tuple[FloatArray, FloatArray]:
        """One plaintext SGD step of the LoRA factors.

        The closed form, independent of the evaluator: the reference the encrypted
        steps are checked against.
        """
        X = self.X
        G = (X @ (self.W0 + A @ B) - self.Y) / X.shape[0]
        grad_a = X.T @ (G @ B.T)
        grad_b = (X @ A).T @ G
        return A - lr * grad_a, B - lr * grad_b


def encrypted_steps(
    params: CKKSParams,
    task: Regression,
    A: FloatArray,
    B: FloatArray,
    lr: float,
    steps: int,
) -> tuple[FloatArray, FloatArray, int]:
    r"""``steps`` SGD steps with encrypted gradients; returns (A, B, refreshes).

    A key owner in this process (:func:`~crypto.he.ckks.local_key_owner` with
    Galois keys) encrypts ``X``, ``Y`` and the factors; the server's evaluator
    (non-interactive within a step) computes :math:`\nabla_A, \nabla_B`. The slot
    sums leave one-slot ciphertexts, so the key owner applies
    :math:`A \leftarrow A - \eta\nabla_A` while refreshing them back into
    replicated weights for the next step (one counted round trip per step, the
    stand-in for the bootstrap a server-side update would need).
    """
    X, Y = task.X, task.Y
    slots = X.shape[0]
    if slots & (slots - 1):
        raise ValueError(f"the token count must be a power of two, got {slots}")
    encrypt, decrypt = local_key_owner(params, galois=True)
    ev = Evaluator(TenSEALBackend(), params.levels)
    x = [Value(encrypt(col)) for col in X.T]
    y = [Value(encrypt(col)) for col in Y.T]

    def replicated(value: float) -> object:
        return encrypt(np.full(slots, value))

    def opened(sums: Secret) -> FloatArray:
        return np.array([[decrypt(v.handle)[0] for v in row] for row in sums])

    for _ in range(steps):
        Ae, Be = encrypted_factors(ev, replicated, A, B)
        out, xa = lora_forward(ev, x, task.W0, Ae, Be)
        grad = [ev.sub(o, t) for o, t in zip(out, y, strict=True)]
        grad_a, grad_b = lora_gradient(ev, x, xa, grad, Be)
        A = A - lr / slots * opened(grad_a)
        B = B - lr / slots * opened(grad_b)
        ev.note("refresh_rounds")
    return A, B, ev.counts.get("refresh_rounds", 0)
