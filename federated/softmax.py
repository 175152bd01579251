r"""The numpy backend of local DP-SGD: multinomial logistic regression, fused steps.

One step on the rows :math:`X_B` of a batch (or on every row, weighted by the
batch's 0/1 mask: constant work) with weights :math:`(W, b)`:

.. math::

    R = \operatorname{softmax}(X_B W + b) - E_{y_B}, \quad
    \tilde R = \operatorname{clip}(R;\ s_B, C), \quad
    g = \big(X_B^T \tilde R,\ \textstyle\sum_i \tilde r_i\big),

where the per-example gradient :math:`x_i \otimes r_i, r_i` has norm
:math:`\lVert r_i\rVert s_i` with :math:`s_i = \sqrt{\lVert x_i\rVert^2 + 1}`,
so the clipped sum never materialises per-example gradients. Sanitizing,
clipping and noising are :mod:`federated.release`'s (:func:`~.release.clip_rows`,
:func:`~.release.add_noise`), the one release path. A round does its work on
buffers it owns (the softmax in place, the weights one flat vector per client,
the step's gradient written into the vector the noise is added to), draws its
noise at once after its batches (the same random stream, in the same order, as
drawing them step by step) and enters the floating-point state once.

Several clients that start from the same weights (an in-process federated
round) run in lockstep (:func:`train_softmax` with several lanes): what is done
row by row (logits' bias, softmax, labels, sanitizing and clipping) or client by
client in a vector (noise, normalization, step) is one numpy call for all the
clients' rows; only the products with each client's own weights and rows are
per client. Every number a client computes is the one it computes alone, bit
for bit: row-wise reductions and element-wise operations do not depend on the
other rows of the array (tests/federated/test_fused.py checks it against the
plain formula).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from defenses.arrays import FloatArray, IntArray

from .release import add_noise, clip_rows, fp_quiet, gaussian_noise


def softmax_(z: FloatArray) -> FloatArray:
    r"""Row-wise softmax, in place: :math:`e^{z - \max z} / \sum e^{z - \max z}`."""
    z -= np.maximum.reduce(z, axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= np.add.reduce(z, axis=1, keepdims=True)
    return z


def row_scale(X: FloatArray) -> FloatArray:
    r"""Row scales :math:`s_i = \sqrt{\lVert x_i\rVert^2 + 1}`.

    A softmax per-example gradient's norm is its residual's times :math:`s_i`.
    """
    return np.asarray(np.sqrt((X * X).sum(axis=1) + 1.0), dtype=np.float64)


def label_table(y: IntArray, k: int, X: FloatArray | None) -> FloatArray:
    r"""Rows :math:`(e_{y_i}, s_i)`: one-hot labels, then :func:`row_scale` of ``X``.

    Without ``X`` (no clipping) only the one-hot labels. One gather of its rows
    gives a batch's labels and scales. Subtracting the one-hot row (0 or 1 in
    each entry) is subtracting 1 at the label, bit for bit.
    """
    table = np.zeros((y.size, k + (X is not None)))
    table[np.arange(y.size), y] = 1.0
    if X is not None:
        table[:, k] = row_scale(X)
    return table


@dataclass(frozen=True)
class Lane:
    """One client's round: its rows, :func:`label_table`, batches and step.

    ``draws`` are the round's batches (row indices); ``sigma=None`` is
    non-private SGD; ``expected_batch`` is the public normalizer :math:`qN`.
    """

    X: FloatArray
    table: FloatArray
    draws: Sequence[IntArray]
    lr: float
    sigma: float | None
    rng: np.random.Generator
    expected_batch: float


def residuals(
    theta: FloatArray, shape: tuple[int, int], X: list[FloatArray], T: FloatArray
) -> FloatArray:
    r"""Stacked :math:`\operatorname{softmax}(X_c W_c + b_c) - E_c` of the lanes.

    ``theta`` holds one flat (W, b) per row, for the blocks ``X`` in order; ``T``
    is the blocks' stacked :func:`label_table` rows (a new array is returned).
    """
    d, k = shape
    if len(X) == 1:
        R = X[0] @ theta[0, : d * k].reshape(d, k)
        R += theta[0, d * k :]
    else:
        R = np.concatenate(
            [x @ t[: d * k].reshape(d, k) for x, t in zip(X, theta, strict=True)]
        )
        R += np.repeat(theta[:, d * k :], [x.shape[0] for x in X], axis=0)
    softmax_(R)
    R -= T[:, :k]
    return R


def _blocks(parts: list[FloatArray]) -> FloatArray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def softmax_step(
    W: FloatArray,
    b: FloatArray,
    X: FloatArray,
    y: IntArray,
    clip: float | None,
    mask: FloatArray | None = None,
) -> tuple[FloatArray, FloatArray]:
    r"""Summed (sanitized, clipped) per-example gradients of the cross-entropy.

    ``mask`` (0/1 per row) keeps only the sampled rows of ``X``: the DP path
    passes every record and the batch as a mask, so a step's work is the same
    whichever and however many records were sampled. The per-example gradient
    is the rank-one pair :math:`(x_i r_i^T, r_i)` with residual
    :math:`r_i = p_i - e_{y_i}`, of norm :math:`\lVert r_i\rVert s_i`, so the
    clipped sum is :math:`X^T (f \odot R)` without materialising per-example
    gradients. With ``clip`` (DP), a residual that is not finite (the server's
    weights overflowed that record's logits) contributes zero, and so does a norm
    that overflows (:func:`~.release.clip_rows`): every record contributes a
    finite vector of norm at most ``clip``.
    """
    k = W.shape[1]
    theta = np.concatenate([np.ravel(W), b])[None, :]
    with fp_quiet():
        table = label_table(y, k, None if clip is None else X)
        R = residuals(theta, W.shape, [X], table)
        if clip is not None:
            clip_rows(R, table[:, k], clip)
        if mask is not None:
            R *= mask[:, None]
        return X.T @ R, np.add.reduce(R, axis=0)


def train_softmax(
    params: Sequence[FloatArray],
    lanes: Sequence[Lane],
    *,
    clip: float,
    constant_work: bool,
) -> list[list[FloatArray]]:
    r"""One round of every lane from ``params``: new (W, b) per lane.

    A step of a DP lane (``sigma`` set) is :math:`\theta \leftarrow \theta -
    \eta\,(g + \mathcal N(0, \sigma^2C^2 I)) / (qN)`; with ``constant_work``
    every row is computed and the batch kept by a 0/1 mask. A non-private lane
    steps by the batch mean of its unclipped gradients and skips an empty batch.
    """
    d, k = params[0].shape
    theta = np.tile(np.concatenate([np.ravel(params[0]), params[1]]), (len(lanes), 1))
    dp = [c for c, lane in enumerate(lanes) if lane.sigma is not None]
    plain = [c for c, lane in enumerate(lanes) if lane.sigma is None]
    with fp_quiet():
        if not plain:
            _dp_rounds(theta, lanes, (d, k), clip, constant_work)
        elif not dp:
            _plain_rounds(theta, lanes, (d, k))
        else:
            some = theta[dp]
            _dp_rounds(some, [lanes[c] for c in dp], (d, k), clip, constant_work)
            theta[dp] = some
            some = theta[plain]
            _plain_rounds(some, [lanes[c] for c in plain], (d, k))
            theta[plain] = some
    return [[t[: d * k].reshape(d, k).copy(), t[d * k :].copy()] for t in theta]


def _dp_rounds(
    theta: FloatArray,
    lanes: Sequence[Lane],
    shape: tuple[int, int],
    clip: float,
    constant_work: bool,
) -> None:
    """DP steps of the lanes whose flat weights are the rows of ``theta`` (in place)."""
    dk, steps = shape[0] * shape[1], [len(lane.draws) for lane in lanes]
    draws = [
        gaussian_noise(lane.rng, (steps[c], theta.shape[1]), lane.sigma or 0.0, clip)
        for c, lane in enumerate(lanes)
    ]
    noise = (
        draws[0][None]
        if len(draws) == 1
        else np.zeros((len(lanes), max(steps), theta.shape[1]))
    )
    if len(draws) > 1:
        for c, draw in enumerate(draws):
            noise[c, : steps[c]] = draw
    scale = np.array([[lane.expected_batch] for lane in lanes])
    lr = np.array([[lane.lr] for lane in lanes])
    total = np.empty_like(theta)
    outs = [(t[:dk].reshape(shape), t[dk:]) for t in total]
    everyone = list(range(len(lanes)))
    for step in range(max(steps)):
        every = step < min(steps)
        on = everyone if every else [c for c in everyone if step < steps[c]]
        index = [lanes[c].draws[step] for c in on]
        if constant_work:
            X = [lanes[c].X for c in on]
            T = _blocks([lanes[c].table for c in on])
        else:
            X = [lanes[c].X[i] for c, i in zip(on, index, strict=True)]
            T = _blocks([lanes[c].table[i] for c, i in zip(on, index, strict=True)])
        R = residuals(theta if every else theta[on], shape, X, T)
        clip_rows(R, T[:, shape[1]], clip)
        if constant_work:
            R *= _blocks([_mask(x.shape[0], i) for x, i in zip(X, index, strict=True)])
        start = 0
        for c, x in zip(on, X, strict=True):
            rows = R[start : start + x.shape[0]]
            np.matmul(x.T, rows, out=outs[c][0])
            np.add.reduce(rows, axis=0, out=outs[c][1])
            start += x.shape[0]
        if every:
            add_noise(total, noise[:, step])
            total /= scale
            total *= lr
            theta -= total
        else:
            part = add_noise(total[on], noise[on, step])
            part /= scale[on]
            part *= lr[on]
            theta[on] -= part


def _mask(n: int, index: IntArray) -> FloatArray:
    """The 0/1 column that keeps the rows ``index`` of ``n``."""
    mask = np.zeros((n, 1))
    mask[index] = 1.0
    return mask


def _plain_rounds(
    theta: FloatArray, lanes: Sequence[Lane], shape: tuple[int, int]
) -> None:
    """Non-private steps of the lanes whose weights are ``theta``'s rows (in place)."""
    dk = shape[0] * shape[1]
    for step in range(max(len(lane.draws) for lane in lanes)):
        on = [
            c
            for c, lane in enumerate(lanes)
            if step < len(lane.draws) and lane.draws[step].size
        ]
        if not on:
            continue
        X = [lanes[c].X[lanes[c].draws[step]] for c in on]
        T = _blocks([lanes[c].table[lanes[c].draws[step]] for c in on])
        R = residuals(theta if len(on) == len(lanes) else theta[on], shape, X, T)
        start = 0
        for c, x in zip(on, X, strict=True):
            rows, m = R[start : start + x.shape[0]], x.shape[0]
            W = theta[c, :dk].reshape(shape)
            W -= lanes[c].lr * (x.T @ rows) / m
            theta[c, dk:] -= lanes[c].lr * np.add.reduce(rows, axis=0) / m
            start += m
