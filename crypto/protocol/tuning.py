r"""Encrypted fine-tuning as messages between a server and the key owner.

One protocol for every model family (the family is a value of the job's program,
:mod:`crypto.protocol.jobs`), on a :class:`~crypto.protocol.wire.Channel`
(:class:`~crypto.protocol.serving.InProcess` or
:class:`~crypto.protocol.transport.Loopback`), under the same rules as inference:

* the key owner (:class:`~crypto.protocol.tuning_client.TuningClient`) sends the public
  context (Galois keys included) and one ``train`` message: the inputs, the
  one-hot targets on the CLS slots and every uploaded secret entry, encrypted,
  with its own update bounds (and, for a converted BERT, the batch size) in the
  public metadata;
* the server (:class:`TuningServer`, on the session loop of
  :class:`~crypto.protocol.serving.SessionServer` shared with inference) holds only a
  :class:`~crypto.protocol.jobs.TuningJob`; it runs the job's program
  (:meth:`~crypto.protocol.jobs.StepProgram.run`), asks for each refresh, roll of
  K and V and unroll of their gradients by a ``refresh``, ``roll`` or ``unroll`` message
  (refreshes in requests of at most :data:`REFRESH_VALUES`), and answers
  ``weights``. Every message it sends states its job's bounds under
  :data:`crypto.program.bounds.BOUNDS_KEY`; it answers ``error`` to a ``train``
  stating others;
* the key owner derives the public schedule of those requests itself
  (:func:`tuning_schedule`: the same
  :meth:`~crypto.protocol.jobs.StepProgram.run`, through the same
  :func:`evaluator` and :func:`chunked` refreshes, on zeros in float64 with a
  recording key owner), admits each request before decrypting, clips,
  answers fresh and checks the ``weights`` reply before decrypting it. Anything
  else gets the one empty ``abort``.

A slot sum leaves TenSEAL a one-slot vector, so a fine-tuning ciphertext may carry
one slot or all of them (``sizes`` 0 in the schedule); a refreshed one-slot value
is answered replicated, as the function-call path did.
"""

from __future__ import annotations

import time
from typing import Any

from ..he.ckks import CKKSParams, TenSEALBackend
from ..he.evaluator import Backend, Evaluator, NumpyBackend, Value
from ..program.bounds import BOUNDS_KEY, UpdateBounds, stated
from ..program.sgd import Fresh
from .jobs import Host, TuningJob
from .schedule import Recorder, Schedule, finished, safe_bound
from .serving import Services, SessionServer
from .wire import Channel, Message, ProtocolError

REFRESH_VALUES = 256
"""Ciphertexts per refresh request of a fine-tuning session (about 100 MB of fresh
answers): a refresh of every weight's gradient goes in several requests, so that
neither side holds the whole batch in serialised form beside its ciphertexts."""


def chunked(refresh: Fresh) -> Fresh:
    """``refresh`` asked in consecutive requests of at most :data:`REFRESH_VALUES`.

    The server's round trips and the schedule's recording key owner are both
    wrapped (by :func:`evaluator`), so the public schedule lists the same
    requests the server makes.
    """

    def in_chunks(values: list[Value]) -> list[Value]:
        out: list[Value] = []
        size = REFRESH_VALUES
        for at in range(0, len(values), size):
            out += refresh(values[at : at + size])
        return out

    return in_chunks


def evaluator(
    backend: Backend, params: CKKSParams, services: Services
) -> tuple[Evaluator, Services]:
    """The evaluator of a fine-tuning program and its services, refreshes chunked.

    The one set-up of the server (ciphertexts) and of :func:`tuning_schedule`
    (zeros in float64).
    """
    refresh = chunked(services.refresh)
    ev = Evaluator(backend, params.levels, refresh)
    return ev, Services(refresh, services.roll, services.unroll)


def tuning_schedule(job: TuningJob, params: CKKSParams) -> Schedule:
    """The schedule of one fine-tuning session, from the job's program and the chain.

    Derived by running the program (:meth:`~crypto.protocol.jobs.StepProgram.run`) in
    float64 on its public zeros with a recording key owner: no value, no batch
    size and not the bounds change which requests it makes. Every ciphertext may
    be one slot or all (``sizes`` 0); bounds are the chain's
    :func:`~crypto.protocol.schedule.safe_bound`.
    """
    program = job.program
    slots = program.slots(params)
    rec = Recorder(program.n_tokens, safe_bound(params), lambda h: 0)
    ev, services = evaluator(
        NumpyBackend(), params, Services(rec.refresh, rec.roll, rec.unroll)
    )
    rec.ev = ev
    plain, meta = program.zeros(slots)
    flat = program.run([Value(p) for p in plain], meta, Host(ev, slots, services))
    return finished(rec, "weights", program.stage, flat, params, 0)


class TuningServer(SessionServer):
    """The fine-tuning server: a public :class:`~crypto.protocol.jobs.TuningJob`.

    :meth:`serve` answers one session: ``context``, then ``train`` (answered by
    ``weights`` after asking the key owner, by message, for the program's round
    trips), until ``close`` or ``abort``. It never holds a secret key. A
    ``train`` message must state the job's bounds (else ``error``), and every
    request and the reply state them (:meth:`statement`).
    """

    def __init__(self, job: TuningJob, params: CKKSParams):
        if not isinstance(job, TuningJob):
            raise TypeError(f"job must be a TuningJob, got {type(job).__name__}")
        if not isinstance(job.bounds, UpdateBounds):
            raise TypeError(
                f"bounds must be UpdateBounds, got {type(job.bounds).__name__}"
            )
        super().__init__(params, None, keep=False)
        self.job = job
        self.bounds = job.bounds

    def handlers(self) -> dict[str, Any]:
        """``train``: the job's step on the upload."""
        return {"train": self._on_train}

    def statement(self) -> dict[str, Any]:
        """The public metadata every server message of the session carries."""
        return {BOUNDS_KEY: self.bounds.statement()}

    def _on_train(self, channel: Channel, pending: list[Message]) -> None:
        message = pending.pop()
        if stated(message.meta) != self.bounds:
            raise ProtocolError(
                f"train message: the stated update bounds "
                f"{str(message.meta.get(BOUNDS_KEY))[:80]} are not the "
                f"job's {self.bounds.statement()}"
            )
        values, meta = self._load(message), message.meta
        del message  # the ciphertexts are kept, not also their bytes
        reply = self._stated(self._train(channel, values, meta)).encode()
        channel.send(reply)

    def _train(
        self, channel: Channel, values: list[Value], meta: dict[str, Any]
    ) -> Message:
        """Run the job's program on the ``train`` message's ``values`` and ``meta``.

        The program owns ``values``: it empties the list once it holds what it
        needs, and each replied ciphertext is freed once serialised.
        """
        start = time.perf_counter()
        ev, services = evaluator(TenSEALBackend(), self.params, self.services(channel))
        slots = self.job.program.slots(self.params)
        flat = self.job.program.run(values, meta, Host(ev, slots, services))
        flat.reverse()
        blobs = []
        while flat:
            blobs.append(flat.pop().handle.serialize())
        seconds = time.perf_counter() - start
        meta = {"counts": dict(ev.counts), "seconds": seconds}
        return Message("weights", self.key, tuple(blobs), meta)


class ProgramServer(TuningServer):
    """The former name of :class:`TuningServer` (the session loop's server)."""


class BertTuningServer(TuningServer):
    """The former name of :class:`TuningServer` for a converted BERT's Q/K/V step."""
