r"""Encrypted fine-tuning as messages between a server and the key owner.

The SGD steps of :mod:`crypto.program.sgd` with the round trips on a
:class:`~crypto.protocol.wire.Channel` (:class:`~crypto.protocol.server.InProcess` or
:class:`~crypto.protocol.transport.Loopback`), under the same rules as inference:

* the key owner (:class:`TuningClient`) sends the public context (Galois keys
  included) and one ``train`` message: its embedded batch (feature-major), the
  one-hot targets on the CLS slots and every trained weight entry, encrypted;
* the server (:class:`TuningServer`, a :class:`ProgramServer`: the session loop
  and the round trips, shared with :mod:`crypto.protocol.qkv_tuning`'s converted
  BERT step) holds only a :class:`TuningJob`: the frozen public matrices, the
  public fold factors, the learning rate, the step count, the batch size (the
  trained matrices are zeros there, their shapes only) and the public
  :class:`~crypto.program.bounds.UpdateBounds` the client bounds the returned weights'
  change to. It runs :func:`sgd_steps` and asks for each refresh, roll of K and
  V and unroll of their gradients by a ``refresh``, ``roll`` or ``unroll``
  message;
* the agreement on the bounds is stated on the wire: the ``train`` message's
  public metadata carries the client's bounds (its own configuration), every
  message of the server (requests and reply) its job's, under
  :data:`crypto.program.bounds.BOUNDS_KEY`; the server answers ``error`` to a ``train``
  stating other bounds than its job's, the key owner refuses (the empty
  ``abort``, nothing of it decrypted) a server message stating other bounds
  than its own, or none;
* the key owner derives the public schedule of those requests itself
  (:func:`tuning_schedule`: the same program on zeros with a recording key owner),
  admits each request before decrypting (:func:`crypto.protocol.schedule.admit`), clips
  to the public bound and answers fresh encryptions; the ``weights`` reply is checked
  (count, level) before it is decrypted. Anything else gets the one empty ``abort``.

A slot sum leaves TenSEAL a one-slot vector, so a fine-tuning ciphertext may carry
one slot or all of them (``sizes`` 0 in the schedule); a refreshed one-slot value
is answered replicated, as the function-call path did.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from defenses.arrays import FloatArray

from ..he.ckks import CKKSParams, TenSEALBackend, fingerprint, load_public
from ..he.evaluator import Evaluator, NumpyBackend, Value
from ..program.bounds import BOUNDS_KEY, DEFAULT_BOUNDS, UpdateBounds, stated
from ..program.net import Net
from ..program.sgd import Fresh, Roll, Unroll, cls_mask, sgd_steps
from .schedule import ANSWERS, Recorder, Schedule, Step, safe_bound
from .wire import Channel, Message, ProtocolError

REFRESH_VALUES = 256
"""Ciphertexts per refresh request of a fine-tuning session (about 100 MB of fresh
answers): a refresh of every weight's gradient goes in several requests, so that
neither side holds the whole batch in serialised form beside its ciphertexts."""


def chunked(refresh: Fresh) -> Fresh:
    """``refresh`` asked in consecutive requests of at most :data:`REFRESH_VALUES`.

    The server's round trips and the schedule's recording key owner are both
    wrapped, so the public schedule lists the same requests the server makes.
    """

    def in_chunks(values: list[Value]) -> list[Value]:
        out: list[Value] = []
        size = REFRESH_VALUES
        for at in range(0, len(values), size):
            out += refresh(values[at : at + size])
        return out

    return in_chunks


@dataclass(frozen=True)
class TuningJob:
    """What the fine-tuning server may know: public weights and hyper-parameters.

    ``net`` holds the frozen public matrices; its trained matrices are zeros
    (their shapes only: the values are the client's secret). ``bounds`` are the
    public bounds the client clips the returned weights' change to
    (:mod:`crypto.program.bounds`), part of the agreement: the client takes them from
    its own configuration and refuses a server stating others.
    """

    net: Net
    fold: dict[str, Any]
    lr: float
    steps: int
    batch: int
    bounds: UpdateBounds = DEFAULT_BOUNDS

    @classmethod
    def public(
        cls,
        net: Net,
        fold: dict[str, Any],
        lr: float,
        steps: int,
        batch: int,
        bounds: UpdateBounds = DEFAULT_BOUNDS,
    ) -> TuningJob:
        """The job for ``net`` with every trained matrix replaced by zeros."""
        mats = dict(net.mats)
        for name in net.trained:
            mats[name] = np.zeros(np.asarray(net.mats[name]).shape)
        return cls(replace(net, mats=mats), dict(fold), lr, steps, batch, bounds)

    @property
    def slots(self) -> int:
        """Packed vector length: batch x tokens."""
        return self.batch * self.net.n_tokens

    @property
    def mask(self) -> FloatArray:
        """``1/B`` on the CLS slots (the mean over the batch), 0 elsewhere."""
        return cls_mask(self.batch, self.net.n_tokens)

    def shapes(self) -> list[tuple[int, int]]:
        """Shapes of the trained matrices, in ``net.trained`` order."""
        out = []
        for name in self.net.trained:
            rows, cols = np.asarray(self.net.mats[name]).shape
            out.append((int(rows), int(cols)))
        return out

    def entries(self) -> int:
        """Trained weight entries (one ciphertext each)."""
        return sum(r * c for r, c in self.shapes())


def tuning_schedule(
    job: TuningJob, params: CKKSParams, d: int, classes: int
) -> Schedule:
    """The schedule of one fine-tuning session, from the job's program and the chain.

    Derived by running :func:`sgd_steps` in float64 on zeros with a recording key
    owner; every ciphertext may be one slot or all (``sizes`` 0), bounds are the
    chain's :func:`~crypto.protocol.schedule.safe_bound`.
    """
    n, slots = job.net.n_tokens, job.slots
    rec = Recorder(n, safe_bound(params), lambda h: 0)
    refresh = chunked(rec.refresh)
    ev = Evaluator(NumpyBackend(), params.levels, refresh)
    rec.ev = ev
    net = copy.deepcopy(job.net)
    for (rows, cols), name in zip(job.shapes(), net.trained, strict=True):
        net.mats[name] = [
            [Value(np.zeros(slots)) for _ in range(cols)] for _ in range(rows)
        ]
    zeros = [Value(np.zeros(slots)) for _ in range(d)]
    targets = [Value(np.zeros(slots)) for _ in range(classes)]
    sgd_steps(
        ev,
        net,
        job.fold,
        zeros,
        targets,
        job.mask,
        job.lr,
        job.steps,
        refresh,
        rec.roll,
        rec.unroll,
    )
    flat = [v for name in net.trained for row in net.mats[name] for v in row]
    reply = Step(
        "weights",
        "updated weights",
        tuple(v.level for v in flat),
        (0,) * len(flat),
        (np.inf,) * len(flat),
    )
    return Schedule(tuple(rec.steps), reply, params)


class ProgramServer:
    """A fine-tuning server of one encrypted program, on a channel of bytes.

    :meth:`serve` answers one session: ``context``, then ``train`` (answered by
    ``weights`` after asking the key owner, by message, for the program's round
    trips), until ``close`` or ``abort``. It never holds a secret key. Subclasses
    implement :meth:`_train` (the program), using :meth:`services` for the round
    trips. ``bounds`` are the job's agreed update bounds: a ``train`` message
    must state them (else ``error``), and every request and the reply state them
    (:meth:`statement`).
    """

    def __init__(self, params: CKKSParams, bounds: UpdateBounds = DEFAULT_BOUNDS):
        if not isinstance(params, CKKSParams):
            raise TypeError(f"params must be CKKSParams, got {type(params).__name__}")
        if not isinstance(bounds, UpdateBounds):
            raise TypeError(f"bounds must be UpdateBounds, got {type(bounds).__name__}")
        self.params = params
        self.bounds = bounds
        self.context: Any = None
        self.key = ""
        self.inbound: list[str] = []

    def serve(self, channel: Channel) -> None:
        """Answer messages on ``channel`` until ``close`` or ``abort``."""
        while True:
            try:
                message = Message.decode(channel.recv())
            except (EOFError, OSError):
                return
            except ValueError as err:
                self._refuse(channel, err)
                continue
            self.inbound.append(message.kind)
            if message.kind in ("close", "abort"):
                return
            try:
                if message.kind == "context" and len(message.blobs) == 1:
                    self.context = load_public(message.blobs[0])
                    self.key = fingerprint(self.context)
                elif message.kind == "train":
                    if stated(message.meta) != self.bounds:
                        raise ProtocolError(
                            f"train message: the stated update bounds "
                            f"{str(message.meta.get(BOUNDS_KEY))[:80]} are not the "
                            f"job's {self.bounds.statement()}"
                        )
                    values, meta = self._load(message), message.meta
                    del message  # the ciphertexts are kept, not also their bytes
                    reply = self._stated(self._train(channel, values, meta))
                    channel.send(reply.encode())
                    del reply  # not kept while waiting for the next message
                else:
                    raise ProtocolError(f"unexpected {message.kind!r} message")
            except _Ended:
                return
            except Exception as err:  # a service answers every request
                self._refuse(channel, err)

    def statement(self) -> dict[str, Any]:
        """The public metadata every server message of the session carries."""
        return {BOUNDS_KEY: self.bounds.statement()}

    def _stated(self, message: Message) -> Message:
        """``message`` with the agreed bounds stated in its metadata."""
        meta = {**message.meta, **self.statement()}
        return Message(message.kind, message.key, message.blobs, meta)

    @staticmethod
    def _refuse(channel: Channel, err: Exception) -> None:
        meta = {"error": str(err), "value_error": isinstance(err, ValueError)}
        channel.send(Message("error", meta=meta).encode())

    def _load(self, message: Message) -> list[Value]:
        from ..he.ckks import load_ciphertext

        if self.context is None:
            raise ProtocolError("no public context yet: send a context message first")
        if message.key != self.key:
            raise ProtocolError("ciphertexts from another context")
        return [
            Value(load_ciphertext(self.context, c, f"{message.kind} ciphertext {i}"))
            for i, c in enumerate(message.blobs)
        ]

    def _ask(
        self, channel: Channel, kind: str, values: list[Value], **meta: Any
    ) -> list[Value]:
        blobs = tuple(v.handle.serialize() for v in values)
        request = self._stated(Message(kind, self.key, blobs, meta)).encode()
        del blobs
        channel.send(request)
        del request
        reply = Message.decode(channel.recv())
        self.inbound.append(reply.kind)
        if reply.kind in ("close", "abort"):
            raise _Ended
        if reply.kind != ANSWERS[kind]:
            raise ProtocolError(f"expected {ANSWERS[kind]!r}, got {reply.kind!r}")
        return self._load(reply)

    def services(self, channel: Channel) -> tuple[Fresh, Roll, Unroll]:
        """The refresh, roll and unroll round trips on ``channel``.

        A roll or unroll is one request; a refresh is :func:`chunked`.
        """

        def refresh(vals: list[Value]) -> list[Value]:
            return self._ask(channel, "refresh", vals)

        def roll(vals: list[Value], copies: int) -> list[list[Value]]:
            fresh = self._ask(channel, "roll", vals, copies=copies)
            m = len(vals)
            return [fresh[s * m : (s + 1) * m] for s in range(copies)]

        def unroll(shifted: list[list[Value]]) -> list[Value]:
            flat = [v for row in shifted for v in row]
            return self._ask(channel, "unroll", flat, copies=len(shifted))

        return chunked(refresh), roll, unroll

    def _train(
        self, channel: Channel, values: list[Value], meta: dict[str, Any]
    ) -> Message:
        """Run the program on the ``train`` message's ``values`` and ``meta``.

        The program owns ``values``: it may empty the list once it holds what it
        needs, so that no ciphertext outlives its use.
        """
        raise NotImplementedError


class TuningServer(ProgramServer):
    """The HEFormer fine-tuning server: a :class:`TuningJob` and a public context.

    Its ``train`` runs :func:`sgd_steps` (see :class:`ProgramServer`).
    """

    def __init__(self, job: TuningJob, params: CKKSParams):
        if not isinstance(job, TuningJob):
            raise TypeError(f"job must be a TuningJob, got {type(job).__name__}")
        super().__init__(params, job.bounds)
        self.job = job

    def _train(
        self, channel: Channel, values: list[Value], meta: dict[str, Any]
    ) -> Message:
        start = time.perf_counter()
        job = self.job
        d = len(job.net.centre)
        classes = np.asarray(job.net.mats["classifier"]).shape[1]
        if len(values) != d + classes + job.entries():
            raise ProtocolError(
                f"train message: expected {d + classes + job.entries()} ciphertexts "
                f"(inputs, targets, weights), got {len(values)}"
            )
        net = copy.deepcopy(job.net)
        at = iter(values[d + classes :])
        for (rows, cols), name in zip(job.shapes(), net.trained, strict=True):
            net.mats[name] = [[next(at) for _ in range(cols)] for _ in range(rows)]
        inputs, targets = values[:d], values[d : d + classes]
        values.clear()  # each weight is freed once the step has replaced it

        refresh, roll, unroll = self.services(channel)

        ev = Evaluator(TenSEALBackend(), self.params.levels, refresh)
        sgd_steps(
            ev,
            net,
            job.fold,
            inputs,
            targets,
            job.mask,
            job.lr,
            job.steps,
            refresh,
            roll,
            unroll,
        )
        blobs: list[bytes] = []
        for name in net.trained:
            updated = net.mats[name]
            assert not isinstance(updated, np.ndarray)
            net.mats[name] = []  # each ciphertext is freed once serialised
            blobs += [v.handle.serialize() for row in updated for v in row]
            del updated
        seconds = time.perf_counter() - start
        return Message(
            "weights", self.key, tuple(blobs), {"counts": ev.counts, "seconds": seconds}
        )


class _Ended(Exception):
    """The key owner ended the session."""
