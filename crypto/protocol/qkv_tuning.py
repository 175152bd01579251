r"""The converted BERT's encrypted Q/K/V LoRA step as messages (bytes only).

The step of :mod:`crypto.program.qkv_step` with the key owner's help on a
:class:`~crypto.protocol.wire.Channel` (:class:`~crypto.protocol.server.InProcess` or
:class:`~crypto.protocol.transport.Loopback`), under the rules of
:mod:`crypto.protocol.tuning`:

* the server (:class:`BertTuningServer`, a
  :class:`~crypto.protocol.tuning.ProgramServer`) holds only a :class:`QKVJob`: the
  public folded weights (:class:`~crypto.program.encoder.BertWeights`), the LoRA
  factors' shapes, how many of the last blocks are trained and the agreed public
  :class:`~crypto.program.bounds.UpdateBounds`. On a ``train`` message (the packed
  features, the ``n`` key weights of the mask, the one-hot targets on the CLS slots and
  every block's LoRA factor entries, encrypted; the batch size and the client's stated
  bounds in ``meta``, which must be the job's) it runs :func:`qkv_program`
  (:func:`crypto.program.qkv_step.lora_gradients` under CKKS), asks for each refresh,
  roll of K and V and unroll of their gradients by message, and answers ``weights``: the
  encrypted gradient sums :math:`\bar A_x, \bar B_x` of the trained blocks;
* the key owner (:class:`BertTuningClient`, a
  :class:`~crypto.protocol.tuning_client.TuningClient`) derives the public schedule
  itself (:func:`qkv_schedule`: the same program on zeros with a recording key owner),
  admits each request before decrypting, clips it to the chain's encoding-safe bound,
  answers fresh encryptions, checks the ``weights`` reply (count, level) before
  decrypting it (every server message must state the client's own bounds, else it is
  refused, nothing of it decrypted) and updates its factors, the change of each bounded
  by those public bounds first, :math:`A \leftarrow A - \eta\kappa\bar
  A_{\text{folded}}` for Q and K and :math:`A \leftarrow A - \eta\bar A` for V, :math:`B
  \leftarrow B - \eta\bar B` (:func:`crypto.program.qkv_step.updated`). Anything else
  gets the one ``abort``.

The learning rate never leaves the client. A slot sum leaves TenSEAL a one-slot
vector, so every ciphertext of the schedule may carry one slot or all of them
(``sizes`` 0); a refreshed one-slot value is answered replicated, as on the
function-call path.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from defenses.checks import check_real
from defenses.cost import clock, since

from ..he.ckks import CKKSParams, TenSEALBackend, public_bytes
from ..he.evaluator import Evaluator, NumpyBackend, Value
from ..program.bounds import DEFAULT_BOUNDS, UpdateBounds
from ..program.encoder import BertWeights, lora_factors
from ..program.qkv_step import (
    QKVStep,
    lora_gradients,
    loss_mask,
    step_inputs,
    trained_layers,
    updated,
)
from ..program.sgd import Roll, Unroll
from .schedule import Recorder, Schedule, Step, safe_bound
from .server import InProcess
from .session import follow
from .timing import Floor
from .tuning import ProgramServer, chunked
from .tuning_client import TuningClient
from .wire import Channel, Message, ProtocolError

if TYPE_CHECKING:
    from ..conversion.model import HEBert


def step_slots(params: CKKSParams, n_tokens: int) -> int:
    """Slots of every ciphertext: the chain's slots, whole sequences only."""
    return params.slots - params.slots % n_tokens


@dataclass(frozen=True)
class QKVJob:
    """What the server of a Q/K/V step may know: public weights and shapes.

    ``shapes`` lists every block's LoRA factor (name, rows, cols) in the order of
    :func:`crypto.program.encoder.lora_factors` (their values are the client's secret);
    ``blocks`` is how many of the last blocks are trained; ``bounds`` are the public
    bounds the client clips each factor's change to (:mod:`crypto.program.bounds`), part
    of the agreement, taken from the client's own configuration.
    """

    weights: BertWeights
    shapes: tuple[tuple[str, int, int], ...]
    blocks: int
    bounds: UpdateBounds = DEFAULT_BOUNDS

    @classmethod
    def public(
        cls, model: HEBert, blocks: int = 1, bounds: UpdateBounds = DEFAULT_BOUNDS
    ) -> QKVJob:
        """The job of ``model`` (public weights, factor shapes) for ``blocks``."""
        trained_layers(model, blocks)  # a clear error for a bad count
        shapes = tuple(
            (k, int(M.shape[0]), int(M.shape[1]))
            for k, M in lora_factors(model).items()
        )
        return cls(BertWeights.from_model(model), shapes, blocks, bounds)

    @property
    def trained(self) -> tuple[str, ...]:
        """The trained factors' names, in the order of the reply."""
        first = len(self.weights.blocks) - self.blocks
        return tuple(k for k, _, _ in self.shapes if int(k.split()[1]) >= first)

    def entries(self) -> int:
        """LoRA factor entries of every block (one ciphertext each)."""
        return sum(r * c for _, r, c in self.shapes)

    def uploads(self) -> int:
        """Ciphertexts of a ``train`` message: inputs, key weights, targets, factors."""
        w = self.weights
        return w.d + w.n_tokens + w.n_classes + self.entries()


def qkv_program(
    ev: Evaluator,
    job: QKVJob,
    values: list[Value],
    batch: int,
    slots: int,
    roll: Roll,
    unroll: Unroll,
) -> list[Value]:
    """The server's program: the trained factors' gradient sums, flattened.

    ``values`` is a ``train`` message's content (:meth:`QKVJob.uploads`); the
    gradients come back in :attr:`QKVJob.trained` order, row-major. Refreshes go
    through ``ev``'s own refresh (the caller builds it with the round trip).
    """
    w = job.weights
    d, n, k = w.d, w.n_tokens, w.n_classes
    if len(values) != job.uploads():
        raise ProtocolError(
            f"train message: expected {job.uploads()} ciphertexts (inputs, key "
            f"weights, targets, LoRA factors), got {len(values)}"
        )
    if not 1 <= batch <= slots // n:
        raise ProtocolError(f"train message: {batch} sequences do not fit {slots}")
    lora, at = {}, d + n + k
    for name, rows, cols in job.shapes:
        lora[name] = [values[at + r * cols : at + (r + 1) * cols] for r in range(rows)]
        at += rows * cols
    grads = lora_gradients(
        ev,
        w,
        values[:d],
        values[d : d + n],
        lora,
        roll,
        unroll,
        values[d + n : d + n + k],
        loss_mask(batch, n, slots),
        job.blocks,
    )
    return [v for name in job.trained for row in grads[name] for v in row]


def qkv_schedule(job: QKVJob, params: CKKSParams) -> Schedule:
    """The public schedule of one Q/K/V step, from the job's program and the chain.

    Derived by running :func:`qkv_program` in float64 on zeros (one sequence;
    key weights :math:`1/n`) with a recording key owner: no value and no batch
    size changes which requests the program makes. Every ciphertext may be one
    slot or all (``sizes`` 0); bounds are the chain's
    :func:`~crypto.protocol.schedule.safe_bound`.
    """
    n = job.weights.n_tokens
    slots = step_slots(params, n)
    rec = Recorder(n, safe_bound(params), lambda h: 0)
    ev = Evaluator(NumpyBackend(), params.levels, chunked(rec.refresh))
    rec.ev = ev
    w = job.weights
    values = [Value(np.zeros(slots)) for _ in range(job.uploads())]
    for s in range(n):
        values[w.d + s] = Value(np.full(slots, 1.0 / n))
    flat = qkv_program(ev, job, values, 1, slots, rec.roll, rec.unroll)
    reply = Step(
        "weights",
        "LoRA gradient sums",
        tuple(v.level for v in flat),
        (0,) * len(flat),
        (math.inf,) * len(flat),
    )
    return Schedule(tuple(rec.steps), reply, params)


class BertTuningServer(ProgramServer):
    """The Q/K/V step's server: a :class:`QKVJob` and, later, a public context."""

    def __init__(self, job: QKVJob, params: CKKSParams):
        if not isinstance(job, QKVJob):
            raise TypeError(f"job must be a QKVJob, got {type(job).__name__}")
        super().__init__(params, job.bounds)
        self.job = job

    def _train(
        self, channel: Channel, values: list[Value], meta: dict[str, Any]
    ) -> Message:
        start = time.perf_counter()
        refresh, roll, unroll = self.services(channel)
        ev = Evaluator(TenSEALBackend(), self.params.levels, refresh)
        slots = step_slots(self.params, self.job.weights.n_tokens)
        batch = meta.get("sequences")
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise ProtocolError("train message: meta 'sequences' must be an int")
        flat = qkv_program(ev, self.job, values, batch, slots, roll, unroll)
        seconds = time.perf_counter() - start
        blobs = tuple(v.handle.serialize() for v in flat)
        meta = {"counts": dict(ev.counts), "seconds": seconds}
        return Message("weights", self.key, blobs, meta)


class BertTuningClient(TuningClient):
    """The key owner of a converted BERT's Q/K/V step: secret key, ids, factors.

    Parameters
    ----------
    model : HEBert
        The calibrated converted model (base weights public, LoRA factors secret).
    params : CKKSParams
        The chain (Galois keys are generated: the server's slot sums rotate).
    context : TenSEAL context or None
        An existing private context with Galois keys.
    bounds : UpdateBounds
        The public bounds every step's change of each factor is clipped to before
        the step is returned (:mod:`crypto.program.bounds`; part of the agreement: the
        step's job carries them, the ``train`` message states them, a server
        message stating others is refused before decryption).
    answer_floor : float or "auto"
        As for :class:`~crypto.protocol.tuning_client.TuningClient`.
    """

    def __init__(
        self,
        model: HEBert,
        params: CKKSParams,
        context: Any = None,
        bounds: UpdateBounds = DEFAULT_BOUNDS,
        answer_floor: Floor = "auto",
    ):
        from ..conversion.model import HEBert

        if not isinstance(model, HEBert):
            raise TypeError(f"model must be an HEBert, got {type(model).__name__}")
        if not model.calibration.calibrated:
            raise ValueError("calibrate the converted model before encrypting with it")
        super().__init__(params, model.config.n_tokens, context, answer_floor, bounds)
        self.model = model
        self.counts: dict[str, int] = {}

    def schedule(self, job: QKVJob) -> Schedule:
        """The public schedule of the job's step (:func:`qkv_schedule`)."""
        return qkv_schedule(job, self.params)

    def step(
        self,
        server: BertTuningServer | Channel,
        ids: npt.ArrayLike,
        y: npt.ArrayLike,
        lr: float,
        mask: npt.ArrayLike | None = None,
        blocks: int = 1,
    ) -> QKVStep:
        """One encrypted step over ``server`` (hosted in-process) or a channel.

        Returns the updated factors, bounded (:attr:`bounds`), and the decrypted
        gradients (model convention, as :func:`crypto.program.qkv_step.
        encrypted_qkv_step`); the model itself is not changed
        (:func:`~crypto.program.qkv_step.apply_qkv_step`). The range guard on the
        ids is advisory (logged): a refusal would depend on factors an earlier
        step let the server influence.

        Raises
        ------
        Refused
            When the server leaves the public schedule or states other update
            bounds than :attr:`bounds` (nothing of that message decrypted; the
            session is aborted).
        """
        lr = check_real("lr", lr, 0.0)
        job = QKVJob.public(self.model, blocks, self.bounds)
        self.slots = step_slots(self.params, self.n)
        inputs, targets, _, batch = step_inputs(
            self.model, ids, mask, y, self.slots, guard=False
        )
        schedule = self.schedule(job)
        if not isinstance(server, ProgramServer):
            return self._session(server, job, schedule, inputs, targets, batch, lr)
        connection = InProcess(server)
        try:
            return self._session(connection, job, schedule, inputs, targets, batch, lr)
        finally:
            connection.close()

    def _session(
        self,
        connection: Channel,
        job: QKVJob,
        schedule: Schedule,
        inputs: list[Any],
        targets: Any,
        batch: int,
        lr: float,
    ) -> QKVStep:
        connection.send(
            Message("context", self.key, (public_bytes(self.context),)).encode()
        )
        self.started = clock()
        factors = [
            np.full(self.slots, x) for M in lora_factors(self.model).values()
            for x in M.ravel()
        ]  # fmt: skip

        def upload() -> bytes:
            sealed = self._encrypt("train", [*inputs, *targets, *factors])
            meta = {"sequences": batch, **self.statement()}
            return Message(sealed.kind, sealed.key, sealed.blobs, meta).encode()

        session = follow(connection, schedule, upload, self.answer_agreed)
        self.bytes_up += session.bytes_up
        flat = self.open_reply(connection, schedule.reply, session.reply)
        grads, at = {}, 0
        sizes = {k: (r, c) for k, r, c in job.shapes}
        for name in job.trained:
            rows, cols = sizes[name]
            grads[name] = np.array([f[0] for f in flat[at : at + rows * cols]])
            grads[name] = grads[name].reshape(rows, cols)
            at += rows * cols
        counts = {
            str(k): int(v)
            for k, v in dict(session.reply.meta.get("counts", {})).items()
        }
        counts.update(
            encryptions=self.encryptions,
            decryptions=self.decryptions,
            round_trips=session.round_trips,
        )
        self.counts = counts
        self.elapsed = since(self.started)
        return updated(
            self.model, grads, lr, job.blocks, self.elapsed[0], counts, self.bounds
        )
