r"""The server's SGD steps of the HEFormer's fine-tuning layer on packed values.

:func:`sgd_steps` is the one program every path runs, and :func:`sgd_reply` (those
steps on an upload, replying the updated weights) the one step: the function-call
steps of :mod:`crypto.program.steps` (float64, the key owner's round trips as calls,
:mod:`crypto.program.owner`), the fine-tuning server of
:mod:`crypto.protocol.tuning` (round trips as messages) and the public schedule it
derives on zeros. The round trips are
parameters (:data:`Fresh`, :data:`~crypto.he.evaluator.Roll`,
:data:`~crypto.program.backward.Unroll`), so the program does not know the protocol.
Forward and backward are :mod:`crypto.program.backward`'s on the net's program
(:meth:`~crypto.program.net.Net.program`), the same pass as the converted BERT's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from defenses.arrays import FloatArray

from ..he.evaluator import Evaluator, Roll, Value
from .backward import Trained, Unroll, backward, loss_gradient, train_forward
from .net import Net
from .run import Run, fit

__all__ = ["Fresh", "Roll", "Unroll", "cls_mask", "sgd_reply", "sgd_steps"]

Fresh = Callable[[list[Value]], list[Value]]
"""The key owner's refresh: decrypt and re-encrypt each value (a round trip)."""


def cls_mask(batch: int, n_tokens: int) -> FloatArray:
    r"""The loss mask :math:`m`: ``1/B`` on the CLS slots (the batch mean), else 0."""
    m = np.zeros(batch * n_tokens)
    m[::n_tokens] = 1.0 / batch
    return m


def sgd_steps(
    ev: Evaluator,
    net: Net,
    fold: dict[str, Any],
    zs: list[Value],
    targets: list[Value],
    mask: FloatArray,
    lr: float,
    steps: int,
    fresh: Fresh,
    roll: Roll,
    unroll: Unroll,
) -> None:
    r"""``steps`` SGD steps on ``net``'s trained matrices, in place (server side).

    Each step: forward, :math:`\bar\ell = m\odot(\ell - Y)`, backward, and
    :math:`W \leftarrow W - \eta c^2 \bar W` with the fold factor :math:`c`;
    the trained weights are refreshed (one round trip) before every step but the
    first.
    """
    program, trained = net.program(), Trained(1, net.softmax)
    for step in range(steps):
        if step:
            stale = [v for name in net.trained for row in net.mats[name] for v in row]
            ev.note("refresh_rounds")
            ev.note("refreshed_values", len(stale))
            ev.stage = "weights refresh"
            renewed = iter(fresh(stale))
            for name in net.trained:
                net.mats[name] = [[next(renewed) for _ in r] for r in net.mats[name]]
        run = Run(ev, net.secrets(), roll)
        logits = train_forward(run, program, list(zs), trained)
        dlog = loss_gradient(ev, logits, targets, mask)
        grads = backward(run, program, dlog, unroll, trained)
        del run, logits, dlog  # the activations are not needed past the backward
        flat = [v for G in grads.values() for row in G for v in row]
        [flat] = fit(ev, [flat], 2, "SGD update")
        at = iter(flat)
        grads = {k: [[next(at) for _ in row] for row in G] for k, G in grads.items()}
        del flat, at
        while grads:
            name, G = grads.popitem()
            scale = np.broadcast_to(
                np.asarray(fold[name], dtype=float), (len(G), len(G[0]))
            )
            W = net.mats[name]
            assert not isinstance(W, np.ndarray)
            net.mats[name] = [
                [
                    ev.sub(W[i][j], ev.scale(G[i][j], lr * float(scale[i, j]) ** 2))
                    for j in range(len(G[0]))
                ]
                for i in range(len(G))
            ]


def sgd_reply(
    ev: Evaluator,
    net: Net,
    fold: dict[str, Any],
    upload: tuple[list[Value], list[Value], dict[str, list[list[Value]]]],
    mask: FloatArray,
    lr: float,
    steps: int,
    trips: tuple[Fresh, Roll, Unroll],
) -> list[Value]:
    """The step of an HEFormer arm on its upload: the updated weights, row-major.

    ``upload`` is (inputs, targets, the trained matrices by name), ``trips`` the key
    owner's (refresh, roll, unroll); ``net`` holds the
    frozen public matrices (not changed: a copy takes the uploaded ones, and
    ``upload``'s matrices are released as the copy takes them). The reply lists
    every trained matrix in ``net.trained`` order. The one step of the protocol's
    server (:class:`crypto.protocol.jobs.SGDProgram`) and of the function-call
    steps (:mod:`crypto.program.steps`).
    """
    inputs, targets, secrets = upload
    net = copy.deepcopy(net)
    net.mats.update(secrets)
    secrets.clear()  # each weight is freed once the step has replaced it
    sgd_steps(
        ev,
        net,
        fold,
        inputs,
        targets,
        mask,
        lr,
        steps,
        *trips,
    )
    out: list[Value] = []
    for name in net.trained:
        updated = net.mats.pop(name)
        assert not isinstance(updated, np.ndarray)
        out += [v for row in updated for v in row]
    return out
