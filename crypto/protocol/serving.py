"""The one session loop of every HE server, and the in-process transport.

:class:`SessionServer` answers the messages of one session on a
:class:`~crypto.protocol.wire.Channel`: the public ``context``, then the kinds its
subclass handles (inference: ``lora`` and ``infer``,
:class:`~crypto.protocol.server.Server`; fine-tuning: ``train``,
:class:`~crypto.protocol.tuning.TuningServer`), until ``close`` or ``abort``;
any failure of a request is answered by one ``error`` message and the session
goes on. Its round trips to the key owner (``refresh``, ``roll``,
``unroll``) check the answer's kind and ciphertext count before loading it. It
never holds a secret key: it reads and writes bytes only, and keeps what it
received in its :class:`Transcript`.

:class:`InProcess` runs any server in a thread of this process behind two queues
of bytes; :func:`hosted` gives a client a channel to a server object or passes an
open channel through.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ..he.ckks import CKKSParams, fingerprint, load_ciphertext, load_public
from ..he.evaluator import Value
from .schedule import ANSWERS
from .wire import Channel, Message, ProtocolError

logger = logging.getLogger(__name__)


class Services(NamedTuple):
    """The key owner's round trips, as functions of the server's values.

    ``refresh`` answers each value fresh; ``roll(values, copies)`` the ``copies``
    token rolls of each; ``unroll(shifted)`` the rolled-back sum of the groups.
    """

    refresh: Callable[[list[Value]], list[Value]]
    roll: Callable[[list[Value], int], list[list[Value]]]
    unroll: Callable[[list[list[Value]]], list[Value]]


@dataclass
class Transcript:
    """Every message the server received, in order, and its seconds per request.

    ``keep=False`` records each message's kind with an empty body (a fine-tuning
    upload is every trained weight, encrypted: not kept alive beside its
    ciphertexts).
    """

    inbound: list[tuple[str, Message]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    keep: bool = True

    def record(self, message: Message) -> None:
        """Append one received message (or, with ``keep=False``, its kind)."""
        kept = message if self.keep else Message(message.kind)
        self.inbound.append((message.kind, kept))


class Ended(Exception):
    """The key owner ended the session in the middle of a request."""


class SessionServer:
    """A server of one session on a channel of bytes; subclasses handle kinds.

    Parameters
    ----------
    params : CKKSParams
        The modulus chain the client's context was made with.
    slots : int or None
        The slot count every loaded ciphertext must have (None: any; a slot sum
        leaves TenSEAL a one-slot vector in fine-tuning).
    keep : bool
        Whether the :attr:`transcript` keeps each received message (else kinds).
    """

    def __init__(self, params: CKKSParams, slots: int | None, keep: bool = True):
        if not isinstance(params, CKKSParams):
            raise TypeError(f"params must be CKKSParams, got {type(params).__name__}")
        self.params = params
        self.slots = slots
        self.context: Any = None
        self.key = ""
        self.transcript = Transcript(keep=keep)

    @property
    def inbound(self) -> list[str]:
        """The kinds of the messages received so far, in order."""
        return [kind for kind, _ in self.transcript.inbound]

    def serve(self, channel: Channel) -> None:
        """Answer messages on ``channel`` until ``close`` or ``abort`` (or it breaks).

        A refused message gets an ``error`` reply naming the defect; the session
        goes on. The handler takes the message out of a one-element list, so this
        loop holds no copy of its bytes while the request runs.
        """
        while True:
            try:
                message = Message.decode(channel.recv())
            except (EOFError, OSError):
                return
            except ValueError as err:
                self._refuse(channel, err)
                continue
            self.transcript.record(message)
            if message.kind in ("close", "abort"):
                return
            pending = [message]
            del message
            try:
                self._dispatch(channel, pending)
            except Ended:
                return
            except Exception as err:  # a service answers every request
                self._refuse(channel, err)
            pending.clear()

    def _dispatch(self, channel: Channel, pending: list[Message]) -> None:
        kind = pending[0].kind
        if kind == "context":
            message = pending.pop()
            if len(message.blobs) != 1:
                raise ProtocolError("a context message carries exactly one context")
            self._set_context(message.blobs[0])
            return
        handler = self.handlers().get(kind)
        if handler is None:
            raise ProtocolError(f"unexpected {kind!r} message")
        handler(channel, pending)

    def handlers(self) -> dict[str, Callable[[Channel, list[Message]], None]]:
        """The message kinds this server answers, beside ``context``."""
        return {}

    def _set_context(self, blob: bytes) -> None:
        self.context = load_public(blob)
        self.key = fingerprint(self.context)

    def statement(self) -> dict[str, Any]:
        """Public metadata every message this server sends carries (none here)."""
        return {}

    def _stated(self, message: Message) -> Message:
        """``message`` with :meth:`statement` in its metadata."""
        meta = {**message.meta, **self.statement()}
        return Message(message.kind, message.key, message.blobs, meta)

    @staticmethod
    def _refuse(channel: Channel, err: Exception) -> None:
        logger.info("refused a request: %s", err)
        meta = {
            "error": str(err),
            "value_error": isinstance(err, ValueError | TypeError),
        }
        channel.send(Message("error", meta=meta).encode())

    def _load(self, message: Message) -> list[Value]:
        """The message's ciphertexts under the public context, checked."""
        if self.context is None:
            raise ProtocolError("no public context yet: send a context message first")
        if message.key != self.key:
            raise ProtocolError(
                "ciphertexts from another context: their key fingerprint "
                f"{message.key} is not this server's {self.key}"
            )
        return [
            Value(
                load_ciphertext(
                    self.context, c, f"{message.kind} ciphertext {i}", self.slots
                )
            )
            for i, c in enumerate(message.blobs)
        ]

    def _dump(self, kind: str, values: list[Value], **meta: Any) -> Message:
        """A message of ``values``, serialised, with :meth:`statement` in its meta."""
        blobs = tuple(v.handle.serialize() for v in values)
        return self._stated(Message(kind, self.key, blobs, meta))

    def _request(
        self, channel: Channel, request: Message, reply_kind: str, expect: int
    ) -> list[Value]:
        """Send ``request``; the answer, of ``reply_kind`` and ``expect`` values."""
        data = request.encode()
        del request
        channel.send(data)
        del data
        reply = Message.decode(channel.recv())
        self.transcript.record(reply)
        if reply.kind in ("close", "abort"):
            raise Ended
        if reply.kind != reply_kind or len(reply.blobs) != expect:
            raise ProtocolError(
                f"expected a {reply_kind} message of {expect} ciphertexts, got "
                f"{reply.kind!r} with {len(reply.blobs)}"
            )
        return self._load(reply)

    def _ask(
        self, channel: Channel, kind: str, values: list[Value], **meta: Any
    ) -> list[Value]:
        """One round trip of ``kind`` (``refresh``, ``roll`` or ``unroll``)."""
        copies = int(meta.get("copies", 1))
        expect = {
            "refresh": len(values),
            "roll": copies * len(values),
            "unroll": len(values) // copies,
        }[kind]
        return self._request(
            channel, self._dump(kind, values, **meta), ANSWERS[kind], expect
        )

    def services(self, channel: Channel) -> Services:
        """The refresh, roll and unroll round trips on ``channel``."""

        def refresh(vals: list[Value]) -> list[Value]:
            return self._ask(channel, "refresh", vals)

        def roll(vals: list[Value], copies: int) -> list[list[Value]]:
            fresh = self._ask(channel, "roll", vals, copies=copies)
            m = len(vals)
            return [fresh[s * m : (s + 1) * m] for s in range(copies)]

        def unroll(shifted: list[list[Value]]) -> list[Value]:
            flat = [v for row in shifted for v in row]
            return self._ask(channel, "unroll", flat, copies=len(shifted))

        return Services(refresh, roll, unroll)


class _QueueChannel:
    """One end of a pair of byte queues."""

    def __init__(self, inbox: queue.Queue[bytes], outbox: queue.Queue[bytes]):
        self._inbox, self._outbox = inbox, outbox

    def send(self, data: bytes) -> None:
        self._outbox.put(bytes(data))

    def recv(self) -> bytes:
        return self._inbox.get()


class Serving(Protocol):
    """Anything that serves one session on a channel of bytes (a server)."""

    def serve(self, channel: Channel) -> None:
        """Answer messages on ``channel`` until the session ends."""
        ...


class InProcess:
    """The default transport: the server in a thread of this process, bytes between.

    The server's thread sees only its end of two queues of byte strings. Within one
    process this is a discipline, not isolation (any code can walk the heap); use
    :class:`~crypto.protocol.transport.Loopback` for a process boundary.
    ``server`` is any object with ``serve(channel)``: an inference or fine-tuning
    server, or a test's raw speaker of the wire format.
    """

    def __init__(self, server: Serving):
        self._up: queue.Queue[bytes] = queue.Queue()
        self._down: queue.Queue[bytes] = queue.Queue()
        self._thread = threading.Thread(
            target=server.serve,
            args=(_QueueChannel(self._up, self._down),),
            name="he-server",
            daemon=True,
        )
        self._thread.start()

    def send(self, data: bytes) -> None:
        """Deliver bytes to the server."""
        self._up.put(bytes(data))

    def recv(self) -> bytes:
        """The server's next message (RuntimeError if the server has stopped)."""
        while True:
            try:
                return self._down.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the in-process server has stopped") from None

    def close(self) -> None:
        """End the session and wait for the server's thread."""
        if self._thread.is_alive():
            self._up.put(Message("close").encode())
            self._thread.join()


@contextmanager
def hosted(server: SessionServer | Channel) -> Iterator[Channel]:
    """A channel to ``server``: hosted :class:`InProcess` for this block, or as is.

    A server object (a :class:`SessionServer`) serves one session in a thread and
    is closed at the end of the block; an open channel (``InProcess``,
    :class:`~crypto.protocol.transport.Loopback`, a test's) is passed through untouched.
    """
    if not isinstance(server, SessionServer):
        yield server
        return
    connection = InProcess(server)
    try:
        yield connection
    finally:
        connection.close()
