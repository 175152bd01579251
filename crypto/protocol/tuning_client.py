r"""The key owner of an encrypted fine-tuning session (:mod:`crypto.protocol.tuning`).

:class:`TuningClient` is the one key owner of a step, for any job
(:class:`~crypto.protocol.jobs.TuningJob`: an HEFormer arm or a converted BERT's Q/K/V
factors): it holds the secret key, uploads the inputs, targets and secret
entries in one ``train`` message, answers the server's refreshes, rolls and
unrolls only as the public schedule of :func:`~crypto.protocol.tuning.tuning_schedule`
allows (each admitted before decryption, clipped, answered fresh, padded to the
public answer floor of :mod:`crypto.protocol.timing`), and checks the ``weights`` reply
before decrypting it. What it returns is the decrypted reply: the callers bound
it (:mod:`crypto.program.bounds`) before anything uses it. :class:`BertTuningClient`
binds it to a converted BERT (its inputs, its factors, the bounded update).

The update bounds are the client's own configuration (``bounds``), part of the
agreement: the job it runs must carry them, its ``train`` message states them
and every server message must state the same (:func:`crypto.program.bounds.stated`),
else the client refuses that message before decrypting any of it (the empty
``abort``): a check on public values only, at the first server message that
states others.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_real
from defenses.cost import clock, since

from ..he.ckks import CKKSParams, fingerprint, make_context, public_bytes
from ..he.packing import roll_tokens
from ..program.bounds import BOUNDS_KEY, DEFAULT_BOUNDS, UpdateBounds, stated
from .jobs import TuningJob
from .schedule import ANSWERS, Schedule, Step
from .serving import SessionServer, hosted
from .session import Refused, abort, admit, follow, opened
from .timing import Floor, check_floor, pad, resolve_floor, units
from .tuning import tuning_schedule
from .wire import Channel, Message

if TYPE_CHECKING:
    from ..conversion.model import HEBert
    from ..program.qkv_step import QKVStep


class TuningClient:
    """The key owner of a fine-tuning session: the secret key, data and weights.

    Parameters
    ----------
    params : CKKSParams
        The chain (Galois keys are generated: the server's slot sums rotate).
    n_tokens : int
        Sequence length (rolls and unrolls move whole tokens).
    context : TenSEAL context or None
        An existing private context to use (a :class:`~crypto.finetune.KeyOwner`'s).
    answer_floor : float or "auto"
        Seconds per unit every answer and the reply's decryption are padded to
        (:mod:`crypto.protocol.timing`; default ``"auto"``: measured once per client).
    bounds : UpdateBounds
        The public update bounds of the agreement (:mod:`crypto.program.bounds`): the
        job must carry them, every server message must state them.
    public_context : bytes or None
        :func:`~crypto.he.ckks.public_bytes` of ``context``, if the caller has it
        (a :class:`~crypto.finetune.KeyOwner` keeps it): each session sends it,
        and serializing tens of MB of keys costs about 0.5 s a session.
    """

    def __init__(
        self,
        params: CKKSParams,
        n_tokens: int,
        context: Any = None,
        answer_floor: Floor = "auto",
        bounds: UpdateBounds = DEFAULT_BOUNDS,
        public_context: bytes | None = None,
    ):
        if not isinstance(bounds, UpdateBounds):
            raise TypeError(f"bounds must be UpdateBounds, got {type(bounds).__name__}")
        if public_context is not None and context is None:
            raise ValueError("public_context: give it with the context it serializes")
        if public_context is not None and not isinstance(public_context, bytes):
            raise TypeError(
                f"public_context must be bytes, got {type(public_context).__name__}"
            )
        self.bounds = bounds
        self.params = params
        self.answer_floor = check_floor(answer_floor)
        self.n = n_tokens
        self.context = context if context is not None else make_context(params, True)
        self.key = fingerprint(self.context)
        self.public = public_context
        self.slots = 0
        self.decryptions = 0
        self.encryptions = 0
        self.clipped = 0
        self.bytes_up = 0
        self.started = (0.0, 0.0, 0.0)
        self.elapsed = (0.0, 0.0, 0.0)
        """Wall, CPU and system CPU seconds of the last step, setup excluded (the
        system share is included in the CPU seconds)."""

    def _encrypt(self, kind: str, values: list[FloatArray]) -> Message:
        import tenseal as ts

        self.encryptions += len(values)
        blobs = tuple(ts.ckks_vector(self.context, list(v)).serialize() for v in values)
        return Message(kind, self.key, blobs)

    def statement(self) -> dict[str, Any]:
        """The public metadata of the ``train`` message: the client's bounds."""
        return {BOUNDS_KEY: self.bounds.statement()}

    def agreed(self, step: Step, message: Message) -> None:
        """Refuse a server message that does not state the client's own bounds.

        Reads the message's public metadata only, before anything of it is
        parsed or decrypted.
        """
        if stated(message.meta) != self.bounds:
            raise Refused(
                f"{step.stage}: the server states the update bounds "
                f"{str(message.meta.get(BOUNDS_KEY))[:80]}, not the agreed "
                f"{self.bounds.statement()}"
            )

    def answer_agreed(self, request: Message, step: Step) -> Message:
        """:meth:`answer` a session's request once it states the agreed bounds."""
        self.agreed(step, request)
        return self.answer(request, step)

    def _open(self, step: Step, message: Message) -> list[FloatArray]:
        vectors = admit(step, message, self.context, self.key, self.params, self.slots)
        self.decryptions += len(vectors)
        out, changed = opened(vectors, step.bounds, self.slots)
        self.clipped += changed
        return out

    def floor(self) -> float:
        """Seconds per unit (``"auto"``: measured once, counters left alone)."""
        return resolve_floor(self, self.slots)

    def answer(self, request: Message, step: Step) -> Message:
        """Answer ``request`` as ``step`` (admitted before decryption, clipped).

        Padded to the floor: the answer takes as long whatever the plaintext.
        """
        start, floor = time.perf_counter(), self.floor()
        plain = self._open(step, request)
        if step.kind == "roll":
            plain = [
                roll_tokens(p, self.n, s) for s in range(step.copies) for p in plain
            ]
        elif step.kind == "unroll":
            m = len(plain) // step.copies
            plain = [
                np.sum(
                    [
                        roll_tokens(plain[s * m + i], self.n, -s)
                        for s in range(step.copies)
                    ],
                    axis=0,
                )
                for i in range(m)
            ]
        reply = self._encrypt(ANSWERS[step.kind], plain)
        pad(start, floor, units(step, len(plain)))
        return reply

    def open_reply(
        self, connection: Channel, step: Step, reply: Message
    ) -> list[FloatArray]:
        """Admit, decrypt and clip the final reply, padded to the floor; or abort.

        The reply must state the agreed bounds (:meth:`agreed`).
        """
        start, floor = time.perf_counter(), self.floor()
        try:
            self.agreed(step, reply)
            flat = self._open(step, reply)
        except Refused as err:
            abort(connection, err)
        pad(start, floor, len(step.levels))  # as long whatever the weights
        return flat

    def schedule(self, job: TuningJob) -> Schedule:
        """The public schedule of ``job``'s session (:func:`tuning_schedule`)."""
        return tuning_schedule(job, self.params)

    def train(
        self,
        connection: Channel,
        job: TuningJob,
        secret: dict[str, FloatArray],
        inputs: list[FloatArray],
        targets: FloatArray,
        meta: dict[str, Any] | None = None,
    ) -> tuple[dict[str, FloatArray], dict[str, int]]:
        """Run one session: upload, answer the schedule, decrypt the reply.

        ``secret`` holds the job's uploaded matrices (:attr:`~crypto.protocol.jobs.
        StepProgram.uploaded`: an HEFormer's trained matrices, folded; a
        converted BERT's LoRA factors), ``inputs`` the packed inputs
        (feature-major), ``targets`` the one-hot rows on the CLS slots, ``meta``
        the ``train`` message's public metadata beside the bounds. Returns the
        reply's matrices (:attr:`~crypto.protocol.jobs.StepProgram.returned`: updated
        weights or gradient sums) and the operation counts.

        Raises
        ------
        ValueError
            If ``job`` carries other update bounds than the client's, or the
            upload does not have the job's layout (nothing sent).
        Refused
            When the server leaves the public schedule or states other bounds
            (nothing of that message decrypted; the session is aborted).
        """
        if job.bounds != self.bounds:
            raise ValueError(
                f"job: update bounds {job.bounds} are not the client's {self.bounds}"
            )
        program = job.program
        shapes = {name: (rows, cols) for name, rows, cols in program.uploaded}
        if {k: np.shape(secret[k]) if k in secret else () for k in shapes} != shapes:
            raise ValueError(
                f"secret: expected the matrices {shapes} of the job, got "
                f"{ {k: np.shape(v) for k, v in secret.items()} }"
            )
        uploads = len(inputs) + len(targets) + sum(r * c for r, c in shapes.values())
        if uploads != program.uploads():
            raise ValueError(
                f"train upload: {uploads} ciphertexts, the job takes "
                f"{program.uploads()} (inputs, targets, secret entries)"
            )
        self.slots = program.slots(self.params)
        self.floor()  # measured before the session, from public values only
        schedule = self.schedule(job)
        if self.public is None:
            self.public = public_bytes(self.context)
        connection.send(Message("context", self.key, (self.public,)).encode())
        # the step's clock starts after the session's setup (the public context)
        self.started = clock()
        entries = [
            np.full(self.slots, x) for name in shapes for x in secret[name].ravel()
        ]
        stated_meta = {**(meta or {}), **self.statement()}

        def upload() -> bytes:
            sealed = self._encrypt("train", [*inputs, *targets, *entries])
            return Message("train", sealed.key, sealed.blobs, stated_meta).encode()

        session = follow(connection, schedule, upload, self.answer_agreed)
        self.bytes_up += session.bytes_up
        flat = self.open_reply(connection, schedule.reply, session.reply)
        out, at = {}, 0
        for name, rows, cols in program.returned:
            out[name] = np.array([f[0] for f in flat[at : at + rows * cols]]).reshape(
                rows, cols
            )
            at += rows * cols
        counts = {
            str(k): int(v)
            for k, v in dict(session.reply.meta.get("counts", {})).items()
        }
        counts["encryptions"] = self.encryptions
        counts["decryptions"] = self.decryptions
        counts["round_trips"] = session.round_trips
        self.elapsed = since(self.started)
        return out, counts


class BertTuningClient(TuningClient):
    """A :class:`TuningClient` bound to a converted BERT: its ids, its factors.

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
        the step is returned (:mod:`crypto.program.bounds`; part of the agreement).
    answer_floor : float or "auto"
        As for :class:`TuningClient`.
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

    def step(
        self,
        server: SessionServer | Channel,
        ids: npt.ArrayLike,
        y: npt.ArrayLike,
        lr: float,
        mask: npt.ArrayLike | None = None,
        blocks: int = 1,
    ) -> QKVStep:
        """One encrypted Q/K/V step over ``server`` (hosted in-process) or a channel.

        :meth:`TuningClient.train` on :meth:`~crypto.protocol.jobs.TuningJob.qkv`'s job
        with the model's inputs and factors; returns the updated factors,
        bounded (:attr:`bounds`), and the decrypted gradients (model convention,
        :func:`crypto.program.qkv_step.updated`); the model itself is not changed
        (:func:`~crypto.program.qkv_step.apply_qkv_step`). The range guard on the
        ids is advisory (logged).

        Raises
        ------
        Refused
            When the server leaves the public schedule or states other update
            bounds than :attr:`bounds` (nothing of that message decrypted).
        """
        from ..program.encoder import lora_factors
        from ..program.qkv_step import step_inputs, updated

        lr = check_real("lr", lr, 0.0)
        job = TuningJob.qkv(self.model, blocks, self.bounds)
        slots = job.program.slots(self.params)
        inputs, targets, _, batch = step_inputs(
            self.model, ids, mask, y, slots, guard=False
        )
        with hosted(server) as connection:
            grads, self.counts = self.train(
                connection,
                job,
                lora_factors(self.model),
                inputs,
                targets,
                {"sequences": batch},
            )
        return updated(
            self.model, grads, lr, blocks, self.elapsed[0], self.counts, self.bounds
        )
