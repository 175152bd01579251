"""The honest-but-curious HE server, and the in-process transport that hosts it.

:class:`Server` holds the frozen plaintext weights and the public context the client
sends it; :meth:`Server.serve` answers the messages of one session on a
:class:`~crypto.protocol.wire.Channel` (the layer of :mod:`crypto.program.heformer`
under CKKS, asking the client for refreshes and rolls by message). It never holds a
reference to a :class:`~crypto.protocol.client.Client`, a private context or a secret
key. :class:`InProcess` runs it in a thread of this process behind two queues of bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..he.ckks import (
    CKKSParams,
    TenSEALBackend,
    fingerprint,
    load_ciphertext,
    load_public,
)
from ..he.evaluator import Evaluator, Value
from ..program.encoder import BertWeights
from ..program.encoder import forward as bert_forward
from ..program.heformer import HEWeights, forward
from .wire import Channel, Message, ProtocolError

if TYPE_CHECKING:
    from ..conversion.model import HEBert
    from ..models.heformer import HEFormer

logger = logging.getLogger(__name__)


def public_weights(model: HEFormer | HEBert) -> HEWeights | BertWeights:
    """The public folded weights of an HEFormer or of a converted BERT."""
    from ..conversion.model import HEBert

    if isinstance(model, HEBert):
        return BertWeights.from_model(model)
    return HEWeights.from_model(model)


class _Closed(Exception):
    """The client closed the session in the middle of a request."""


@dataclass
class Transcript:
    """Every message the server received, in order, and its seconds per inference."""

    inbound: list[tuple[str, Message]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def record(self, message: Message) -> None:
        """Append one received message."""
        self.inbound.append((message.kind, message))


class Server:
    """The honest-but-curious server: public context and frozen plaintext weights.

    Parameters
    ----------
    context : bytes or None
        The client's public context (or None: it arrives in a ``context`` message).
    weights : HEWeights or BertWeights
        The public folded weights (of an HEFormer or of a converted BERT).
    params : CKKSParams
        The modulus chain the context was made with.

    Raises
    ------
    ValueError
        If the context holds a secret key or is not a TenSEAL context.
    """

    def __init__(
        self,
        context: bytes | None,
        weights: HEWeights | BertWeights,
        params: CKKSParams,
    ):
        if not isinstance(weights, HEWeights | BertWeights):
            raise TypeError(
                "weights must be HEWeights or BertWeights, got "
                f"{type(weights).__name__}"
            )
        if not isinstance(params, CKKSParams):
            raise TypeError(f"params must be CKKSParams, got {type(params).__name__}")
        self.weights = weights
        self.params = params
        self.context: Any = None
        self.key = ""
        self.transcript = Transcript()
        self.counts: dict[str, int] = {}
        self._lora: dict[str, list[list[Value]]] | None = None
        if context is not None:
            self._set_context(context)

    @classmethod
    def for_model(
        cls, context: bytes | None, model: HEFormer | HEBert, params: CKKSParams
    ) -> Server:
        """A server for the public part of ``model`` (HEFormer or converted BERT)."""
        return cls(context, public_weights(model), params)

    def _set_context(self, blob: bytes) -> None:
        self.context = load_public(blob)
        self.key = fingerprint(self.context)
        self._lora = None

    def _load(self, message: Message) -> list[Value]:
        if self.context is None:
            raise ProtocolError("no public context yet: send a context message first")
        if message.key != self.key:
            raise ProtocolError(
                "ciphertexts from another context: their key fingerprint "
                f"{message.key} is not this server's {self.key}"
            )
        slots = self.params.slots - self.params.slots % self.weights.n_tokens
        return [
            Value(
                load_ciphertext(
                    self.context, c, f"{message.kind} ciphertext {i}", slots
                )
            )
            for i, c in enumerate(message.blobs)
        ]

    def _dump(self, kind: str, values: list[Value], **meta: Any) -> Message:
        return Message(
            kind, self.key, tuple(v.handle.serialize() for v in values), meta
        )

    def serve(self, channel: Channel) -> None:
        """Answer messages on ``channel`` until a ``close`` message (or it breaks).

        A refused message gets an ``error`` reply naming the defect; the session
        goes on.
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
            try:
                self._handle(channel, message)
            except _Closed:
                return
            except Exception as err:  # a service answers every request
                self._refuse(channel, err)

    @staticmethod
    def _refuse(channel: Channel, err: Exception) -> None:
        logger.info("refused a request: %s", err)
        meta = {
            "error": str(err),
            "value_error": isinstance(err, ValueError | TypeError),
        }
        channel.send(Message("error", meta=meta).encode())

    def _handle(self, channel: Channel, message: Message) -> None:
        if message.kind == "context":
            if len(message.blobs) != 1:
                raise ProtocolError("a context message carries exactly one context")
            self._set_context(message.blobs[0])
        elif message.kind == "lora":
            self._lora = self._factors(message)
        elif message.kind == "infer":
            channel.send(self._infer(channel, message).encode())
        else:
            raise ProtocolError(f"unexpected {message.kind!r} message")

    def _factors(self, message: Message) -> dict[str, list[list[Value]]]:
        names, shapes = message.meta.get("names"), message.meta.get("shapes")
        flat = self._load(message)
        if (
            not isinstance(names, list)
            or not isinstance(shapes, list)
            or len(names) != len(shapes)
            or not all(isinstance(s, list) and len(s) == 2 for s in shapes)
            or sum(int(r) * int(c) for r, c in shapes) != len(flat)
        ):
            raise ProtocolError("lora message: names and shapes do not match the blobs")
        out, at = {}, 0
        for name, (rows, cols) in zip(names, shapes, strict=True):
            out[str(name)] = [
                flat[at + r * cols : at + (r + 1) * cols] for r in range(rows)
            ]
            at += rows * cols
        return out

    def _request(
        self, channel: Channel, request: Message, reply_kind: str, expect: int
    ) -> list[Value]:
        channel.send(request.encode())
        reply = Message.decode(channel.recv())
        self.transcript.record(reply)
        if reply.kind in ("close", "abort"):
            raise _Closed
        if reply.kind != reply_kind or len(reply.blobs) != expect:
            raise ProtocolError(
                f"expected a {reply_kind} message of {expect} ciphertexts, got "
                f"{reply.kind!r} with {len(reply.blobs)}"
            )
        return self._load(reply)

    def _infer(self, channel: Channel, message: Message) -> Message:
        """Evaluate the layer on an ``infer`` message; refresh by asking the client."""
        start = time.perf_counter()
        w = self.weights
        d, n = w.d, w.n_tokens
        interactive = message.meta.get("interactive")
        if not isinstance(interactive, bool):
            raise ProtocolError("infer message: meta 'interactive' must be a bool")
        if self._lora is None:
            raise ProtocolError("send the LoRA factors (a lora message) before infer")
        values = self._load(message)

        def refresh(vals: list[Value]) -> list[Value]:
            return self._request(
                channel, self._dump("refresh", vals), "refreshed", len(vals)
            )

        def roll(vals: list[Value], copies: int) -> list[list[Value]]:
            request = self._dump("roll", vals, copies=copies)
            fresh = self._request(channel, request, "rolled", copies * len(vals))
            m = len(vals)
            return [fresh[s * m : (s + 1) * m] for s in range(copies)]

        ev = Evaluator(
            TenSEALBackend(), self.params.levels, refresh if interactive else None
        )
        if isinstance(w, BertWeights):
            if not interactive:
                raise ProtocolError(
                    "the converted BERT runs interactively only (its blocks need "
                    "refreshes and rolls)"
                )
            if len(values) != d + n:
                raise ProtocolError(
                    f"expected {d} input and {n} key-weight ciphertexts, got "
                    f"{len(values)}"
                )
            logits = bert_forward(ev, w, values[:d], values[d:], self._lora, roll)
        elif interactive:
            if len(values) != d:
                raise ProtocolError(
                    f"expected {d} input ciphertexts, got {len(values)}"
                )
            logits = forward(ev, w, values, self._lora, roll=roll)
        else:
            if len(values) != d * (n + 1):
                raise ProtocolError(
                    f"non-interactive inference expects {d * (n + 1)} ciphertexts "
                    f"(inputs and {n} rolled copies), got {len(values)}"
                )
            rolled = [values[d + s * d : d + (s + 1) * d] for s in range(n)]
            logits = forward(ev, w, values[:d], self._lora, rolled_z=rolled)
        for k, v in ev.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        seconds = time.perf_counter() - start
        self.transcript.seconds.append(seconds)
        return self._dump("logits", logits, counts=dict(ev.counts), seconds=seconds)


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
    :class:`~crypto.protocol.transport.Loopback` for a process boundary. ``server`` is
    any object with ``serve(channel)``: a :class:`Server`, a fine-tuning server, or a
    test's raw speaker of the wire format.
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
