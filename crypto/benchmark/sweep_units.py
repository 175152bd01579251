r"""The sweep's operation counts and the unit costs of its operations.

:func:`count_model` fits each arm's exact counts on simulated steps of small shapes
(:data:`COUNT_DESIGN`) and checks them on larger ones (:data:`COUNT_CHECK`);
:func:`unit_costs` times each counted operation in isolation under CKKS.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch

from ..he.ckks import TenSEALBackend
from ..he.costmodel import CountModel, Shape
from ..models.heformer import HEFormer, ModelConfig
from ..models.train import TrainConfig, pretrain
from ..program.folding import Arm
from ..program.steps import simulated_step
from ..protocol.finetune import KeyOwner
from ..tasks import Sequences

COUNT_DESIGN = tuple(
    Shape(d, f, n, h, 2)
    for d, f, n, h in (
        (2, 1, 2, 1),
        (2, 1, 2, 2),
        (2, 1, 4, 1),
        (2, 2, 2, 1),
        (2, 1, 4, 2),
        (2, 2, 2, 2),
        (3, 1, 2, 1),
        (2, 3, 2, 1),
        (2, 1, 8, 1),
        (2, 2, 4, 1),
        (4, 1, 2, 2),
        (4, 1, 2, 1),
        (3, 1, 4, 1),
        (3, 2, 2, 1),
        (6, 1, 2, 3),
    )
)
"""Fifteen small shapes that determine every monomial of the count polynomials."""
COUNT_CHECK = (Shape(8, 16, 4, 2, 2), Shape(12, 20, 8, 3, 2))
"""Larger shapes the fitted counts must reproduce exactly."""


def pretrained_model(data: Sequences, shape: Shape, epochs: int, seed: int) -> HEFormer:
    """A model of ``shape`` pretrained on ``data`` (where the sweep's steps start)."""
    config = ModelConfig(
        n_tokens=shape.n_tokens,
        token_dim=data.X.shape[2],
        d=shape.d,
        heads=shape.heads,
        ffn=shape.ffn,
        n_classes=data.n_classes,
    )
    return pretrain(
        data,
        config,
        torch.Generator().manual_seed(seed),
        TrainConfig(epochs=epochs, batch=128),
        TrainConfig(epochs=1, lr=3e-3, batch=128, penalty=10.0),
    )


def count_model(arm: Arm, seed: int = 0) -> tuple[CountModel, float]:
    """The arm's exact operation counts and their largest error on larger shapes."""
    rng = np.random.default_rng(seed)

    def counted(shape: Shape) -> dict[str, int]:
        X = rng.random((32, shape.n_tokens, 4))
        data = Sequences(X, rng.integers(0, 10, 32), 10)
        model = pretrained_model(data, shape, 1, seed)
        b = shape.batch
        return simulated_step(model, X[:b], data.y[:b], 0.1, arm).counts

    model = CountModel.fit(COUNT_DESIGN, [counted(s) for s in COUNT_DESIGN])
    return model, model.max_error(COUNT_CHECK, [counted(s) for s in COUNT_CHECK])


def unit_costs(owner: KeyOwner, size: int, reps: int = 20) -> dict[str, float]:
    r"""CPU seconds of each operation of the step, timed in isolation.

    On ciphertexts of ``size`` slots as the server holds them (loaded under the
    public context); a rotation is a slot sum's time over its
    :math:`\lceil\log_2 \text{size}\rceil` rotate-and-add rounds; a polynomial
    is of degree 3 (the median degree of the step's polynomials); a replication is
    what a subtraction of a one-slot vector (a slot sum) from a full one costs
    beyond a subtraction of two full ones.
    """
    rng = np.random.default_rng(0)
    values = rng.random(size)
    a, b = owner.encrypt(values), owner.encrypt(values[::-1].copy())
    backend = TenSEALBackend()
    one = backend.sum_slots(b)

    def timed(operation: Callable[[], object]) -> float:
        start = time.process_time()
        for _ in range(reps):
            operation()
        return (time.process_time() - start) / reps

    return {
        "ct_ct_mul": timed(lambda: backend.mul(a, b)),
        "ct_pt_mul": timed(lambda: backend.mul_scalar(a, 0.37)),
        "rotations": timed(lambda: backend.sum_slots(a)) / math.ceil(math.log2(size)),
        "polyval": timed(lambda: backend.polyval(a, [0.1, 0.2, 0.3, 0.4])),
        "replications": max(
            0.0,
            timed(lambda: backend.sub(a, one)) - timed(lambda: backend.sub(a, b)),
        ),
        "encryptions": timed(lambda: owner.encrypt(values)),
        "decryptions": timed(lambda: owner.decrypt(a)),
    }
