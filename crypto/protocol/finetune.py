r"""The HEFormer's encrypted fine-tuning step as messages, and the key owner's key.

:func:`encrypted_step` runs the SGD steps of :mod:`crypto.program.sgd` under CKKS
(TenSEAL) between the key owner (:class:`~crypto.protocol.tuning_client.
TuningClient`) and a public-context server (:class:`~crypto.protocol.tuning.
TuningServer`) on :class:`~crypto.protocol.server.InProcess` or
:class:`~crypto.protocol.transport.Loopback`; the client's side of the step (the
batch's checks, the fold, the unfold) is :mod:`crypto.program.steps`'s, and the
returned update passes the client's public bounds (:mod:`crypto.program.bounds`).
:class:`KeyOwner` lends a secret key to several steps (the benchmarks').
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_int, check_real

from ..he.ckks import CKKSParams, load_public, make_context, public_bytes
from ..models.heformer import HEFormer
from ..program.bounds import DEFAULT_BOUNDS, UpdateBounds, bound_update
from ..program.folding import LORA_GK, Arm
from ..program.steps import (
    TRAIN_PARAMS,
    StepResult,
    _check_batch,
    _check_step,
    _prepare,
    _unfold,
)
from .jobs import TuningJob
from .serving import hosted
from .timing import Floor
from .transport import Loopback
from .tuning import TuningServer
from .tuning_client import TuningClient


class KeyOwner:
    """The client side of the fine-tuning protocol (holds the secret key).

    ``encrypt`` hands the server ciphertexts loaded under the public context only
    (serialised and deserialised, as over the wire); ``decrypt`` and the round
    trips (refresh, roll, unroll) reload server ciphertexts under the secret
    context.
    """

    def __init__(self, params: CKKSParams, n_tokens: int):
        self.params = params
        self.n = n_tokens
        self.context = make_context(params, galois=True)
        self.public_blob = public_bytes(self.context)
        """The public context as sent (serialized once, for every session)."""
        self.public = load_public(self.public_blob)
        self.bytes_up = 0

    def encrypt(self, values: FloatArray) -> Any:
        """A ciphertext of ``values`` as the server receives it."""
        import tenseal as ts

        blob = ts.ckks_vector(
            self.context, list(np.asarray(values, dtype=float))
        ).serialize()
        self.bytes_up += len(blob)
        return ts.ckks_vector_from(self.public, blob)

    def decrypt(self, handle: Any) -> FloatArray:
        """Decrypt a server ciphertext."""
        import tenseal as ts

        ct = ts.ckks_vector_from(self.context, handle.serialize())
        return np.asarray(ct.decrypt(), dtype=np.float64)


def encrypted_step(
    model: HEFormer,
    X: FloatArray,
    y: npt.ArrayLike,
    lr: float,
    arm: Arm = LORA_GK,
    steps: int = 1,
    params: CKKSParams = TRAIN_PARAMS,
    owner: KeyOwner | None = None,
    transport: str = "inprocess",
    bounds: UpdateBounds = DEFAULT_BOUNDS,
    server: Callable[[TuningJob, CKKSParams], TuningServer] = TuningServer,
    answer_floor: Floor = "auto",
) -> StepResult:
    """``steps`` encrypted SGD steps (TenSEAL) as messages with a public-context server.

    The server (:class:`~crypto.protocol.tuning.TuningServer`, public weights only) runs
    in a thread (``transport="inprocess"``) or another process (``"loopback"``); the key
    owner answers only the public schedule of refreshes, rolls and unrolls
    (:func:`~crypto.protocol.tuning.tuning_schedule`). ``owner`` lends its key;
    ``server`` makes the server from the public job (a test's malicious one);
    ``answer_floor`` pads the key owner's answers (:mod:`crypto.protocol.timing`). The
    returned weights' change is bounded by the public ``bounds`` (non-finite to 0, per
    entry, in norm: :mod:`crypto.program.bounds`), the client's, which the job carries
    and every server message must state (else refused before decryption), and the range
    guard is advisory (logged), so nothing the client does next depends on what the
    server sent.
    """
    if transport not in ("inprocess", "loopback"):
        raise ValueError(
            f"transport must be 'inprocess' or 'loopback', got {transport!r}"
        )
    X, _ = _check_batch(model, X, y, guard=False)
    check_real("lr", lr, 0.0, open_low=True)
    check_int("steps", steps, 1)
    if not isinstance(arm, Arm):
        raise TypeError(f"arm must be an Arm, got {type(arm).__name__}")
    if params.slots < X.shape[0] * model.config.n_tokens:
        raise ValueError(
            f"X: {X.shape[0]} sequences of {model.config.n_tokens} tokens exceed "
            f"{params.slots} slots"
        )
    lr, steps = _check_step(lr, steps, arm)
    if not isinstance(bounds, UpdateBounds):
        raise TypeError(f"bounds must be UpdateBounds, got {type(bounds).__name__}")
    net, fold, packed, onehot, b = _prepare(model, X, y, arm, guard=False)
    job = TuningJob.sgd(net, fold, lr, steps, b, bounds)
    secret = {name: np.asarray(net.mats[name]) for name in net.trained}
    client = TuningClient(
        params,
        model.config.n_tokens,
        owner.context if owner is not None else None,
        answer_floor,
        bounds,
        owner.public_blob if owner is not None else None,
    )
    made = server(job, params)
    host = Loopback(server=made) if transport == "loopback" else hosted(made)
    with host as connection:
        folded, counts = client.train(connection, job, secret, packed, onehot)
    seconds, cpu, system = client.elapsed
    if owner is not None:
        owner.bytes_up += client.bytes_up
    returned = _unfold(folded, fold, lr, strict=False)
    weights, clipped = bound_update(_unfold(secret, fold, lr), returned, bounds)
    return StepResult(weights, counts, seconds, cpu, system, clipped, bounds)
