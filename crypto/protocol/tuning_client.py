r"""The key owner of an encrypted fine-tuning session (:mod:`crypto.protocol.tuning`).

:class:`TuningClient` holds the secret key, uploads the batch, targets and trained
weights in one ``train`` message, answers the server's refreshes, rolls and
unrolls only as the public schedule of :func:`~crypto.protocol.tuning.tuning_schedule`
allows (each admitted before decryption, clipped, answered fresh, padded to the
public answer floor of :mod:`crypto.protocol.timing`), and checks the ``weights`` reply
before decrypting it. What it returns is the decrypted reply: the callers bound
it (:mod:`crypto.program.bounds`) before anything uses it.

The update bounds are the client's own configuration (``bounds``), part of the
agreement: the job it runs must carry them, its ``train`` message states them
and every server message must state the same (:func:`crypto.program.bounds.stated`),
else the client refuses that message before decrypting any of it (the empty
``abort``): a check on public values only, at the first server message that
states others.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from defenses.arrays import FloatArray
from defenses.cost import clock, since

from ..he.ckks import CKKSParams, fingerprint, make_context, public_bytes
from ..he.packing import roll_tokens
from ..program.bounds import BOUNDS_KEY, DEFAULT_BOUNDS, UpdateBounds, stated
from .schedule import ANSWERS, Step
from .session import Refused, abort, admit, clip, follow
from .timing import Floor, check_floor, pad, resolve_floor, units
from .tuning import TuningJob, tuning_schedule
from .wire import Channel, Message


class TuningClient:
    """The key owner of a fine-tuning session: the secret key, data and weights.

    Parameters
    ----------
    params : CKKSParams
        The chain (Galois keys are generated: the server's slot sums rotate).
    n_tokens : int
        Sequence length (rolls and unrolls move whole tokens).
    context : TenSEAL context or None
        An existing private context to use (a
        :class:`~crypto.protocol.finetune.KeyOwner`'s).
    answer_floor : float or "auto"
        Seconds per unit every answer and the reply's decryption are padded to
        (:mod:`crypto.protocol.timing`; default ``"auto"``: measured once per client).
    bounds : UpdateBounds
        The public update bounds of the agreement (:mod:`crypto.program.bounds`): the
        job must carry them, every server message must state them.
    """

    def __init__(
        self,
        params: CKKSParams,
        n_tokens: int,
        context: Any = None,
        answer_floor: Floor = "auto",
        bounds: UpdateBounds = DEFAULT_BOUNDS,
    ):
        if not isinstance(bounds, UpdateBounds):
            raise TypeError(f"bounds must be UpdateBounds, got {type(bounds).__name__}")
        self.bounds = bounds
        self.params = params
        self.answer_floor = check_floor(answer_floor)
        self.n = n_tokens
        self.context = context if context is not None else make_context(params, True)
        self.key = fingerprint(self.context)
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
        out = []
        for v, bound in zip(vectors, step.bounds, strict=True):
            plain = np.asarray(v.decrypt(), dtype=np.float64)
            clipped = clip(plain, bound)
            self.clipped += int(np.count_nonzero(clipped != plain))
            out.append(
                clipped
                if clipped.size == self.slots
                else np.full(self.slots, clipped[0])
            )
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

    def train(
        self,
        connection: Channel,
        job: TuningJob,
        secret: dict[str, FloatArray],
        packed: list[FloatArray],
        targets: FloatArray,
    ) -> tuple[dict[str, FloatArray], dict[str, int]]:
        """Run one session: upload, answer the schedule, decrypt the weights.

        ``secret`` holds the trained matrices (folded), ``packed`` the embedded
        batch (feature-major), ``targets`` the one-hot rows on the CLS slots.
        Returns the updated folded matrices and the operation counts.

        Raises
        ------
        ValueError
            If ``job`` carries other update bounds than the client's (nothing
            sent).
        Refused
            When the server leaves the public schedule or states other bounds
            (nothing of that message decrypted; the session is aborted).
        """
        if job.bounds != self.bounds:
            raise ValueError(
                f"job: update bounds {job.bounds} are not the client's {self.bounds}"
            )
        self.slots = job.slots
        self.floor()  # measured before the session, from public values only
        schedule = tuning_schedule(job, self.params, len(packed), len(targets))
        connection.send(
            Message("context", self.key, (public_bytes(self.context),)).encode()
        )
        # the step's clock starts after the session's setup (the public context)
        self.started = clock()
        entries = [
            np.full(job.slots, x)
            for name in job.net.trained
            for x in secret[name].ravel()
        ]

        def upload() -> bytes:
            sealed = self._encrypt("train", [*packed, *targets, *entries])
            return Message("train", sealed.key, sealed.blobs, self.statement()).encode()

        session = follow(connection, schedule, upload, self.answer_agreed)
        self.bytes_up += session.bytes_up
        flat = self.open_reply(connection, schedule.reply, session.reply)
        out, at = {}, 0
        for (rows, cols), name in zip(job.shapes(), job.net.trained, strict=True):
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
