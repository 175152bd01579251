"""Encrypted inference between a key-holding client and a public-context server.

The client (Rho et al., 2025, Fig. 1) embeds its sequences with the public embedding,
encrypts them in the feature-major layout of :mod:`crypto.packing` together with its
secret LoRA factors, and sends only bytes (:class:`~crypto.wire.Message`). The
server holds the frozen plaintext weights and, once the client has sent it, the
public context (no secret key); it evaluates the layer and answers encrypted logits.
Without bootstrapping (TenSEAL has none) the server *asks* the client, by a
``refresh`` or ``roll`` message that the client answers, for refreshes (decrypt and
re-encrypt, counted as bootstrap stand-ins) and for the rolled copies of K and V
(the interactive configuration), or runs the whole layer in a larger ring from
client-rolled inputs (the non-interactive configuration).

Trust boundary: :meth:`Server.serve` reads and writes byte strings on a
:class:`~crypto.wire.Channel` and never holds a reference to a :class:`Client`, a
private context or a secret key. :class:`InProcess` (the default transport) runs it
in a thread of this process behind two queues of bytes; :mod:`crypto.transport` runs
it in another process over a loopback socket, so the boundary is a process boundary.
Every message the server receives is kept in its :class:`Transcript`; the audit of
:mod:`crypto.attacks` checks it holds only the public context and ciphertexts.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from defenses.checks import check_int
from defenses.cost import count

from .ckks import (
    CKKSParams,
    TenSEALBackend,
    fingerprint,
    load_ciphertext,
    load_public,
    make_context,
    public_bytes,
)
from .evaluator import Evaluator, Value
from .heval import HEWeights, forward, lora_factors
from .packing import pack, roll_tokens
from .tasks import check_sequences
from .wire import Channel, Message

if TYPE_CHECKING:
    from .model import HEFormer

logger = logging.getLogger(__name__)
FloatArray = npt.NDArray[np.float64]


class ProtocolError(ValueError):
    """The other party sent a message the protocol does not allow."""


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


@dataclass(frozen=True)
class Exchange:
    """The traffic of one encrypted inference (one packed batch), client-measured.

    ``round_trips`` counts the inference request itself plus every refresh or roll
    request the client answered; ``bytes_up`` and ``bytes_down`` are the wire sizes
    of the messages sent each way for it (the session's context and LoRA upload are
    ``setup_bytes`` of :class:`Client`).
    """

    sequences: int
    bytes_up: int
    bytes_down: int
    round_trips: int
    server_s: float
    counts: dict[str, int]


class Client:
    """The data owner: holds the secret key, the data and the LoRA factors.

    Parameters
    ----------
    model : HEFormer
        The calibrated Gaussian-kernel model (its base weights are public, its LoRA
        factors are the client's secret).
    params : CKKSParams
        The modulus chain.
    """

    def __init__(self, model: HEFormer, params: CKKSParams):
        if not isinstance(params, CKKSParams):
            raise TypeError(f"params must be CKKSParams, got {type(params).__name__}")
        if not hasattr(model, "config") or not hasattr(model, "calibration"):
            raise TypeError(f"model must be an HEFormer, got {type(model).__name__}")
        self.model = model
        self.params = params
        self.context = make_context(params)
        self.key = fingerprint(self.context)
        self.refreshes = 0
        self.refreshed = 0
        self.setup_bytes = 0
        self.exchanges: list[Exchange] = []

    @property
    def _slots(self) -> int:
        return self.params.slots - self.params.slots % self.model.config.n_tokens

    def public_context(self) -> bytes:
        """Serialised context without the secret key."""
        return public_bytes(self.context)

    def _encrypt(
        self, kind: str, values: list[FloatArray], meta: dict[str, Any] | None = None
    ) -> Message:
        import tenseal as ts

        blobs = tuple(ts.ckks_vector(self.context, list(v)).serialize() for v in values)
        return Message(kind, self.key, blobs, meta or {})

    def _decrypt(self, message: Message) -> list[FloatArray]:
        if message.key != self.key:
            raise ProtocolError("ciphertexts were made under another key")
        return [
            np.asarray(
                load_ciphertext(
                    self.context, c, f"{message.kind} ciphertext {i}", self._slots
                ).decrypt(),
                dtype=np.float64,
            )
            for i, c in enumerate(message.blobs)
        ]

    def check_inputs(self, X: npt.ArrayLike) -> FloatArray:
        """``X`` as float64 sequences of the model's shape, finite, at least one."""
        c = self.model.config
        return check_sequences(X, c.n_tokens, c.token_dim)

    def embed(self, X: npt.ArrayLike) -> FloatArray:
        """Public embedding z = x W_e + P, after the range guard on the plaintext."""
        import torch

        from .train import predict_logits

        X = self.check_inputs(X)
        predict_logits(self.model, X, guard=True)
        with torch.no_grad():
            z = self.model.embed_tokens(torch.as_tensor(X, dtype=torch.float64))
        return np.asarray(z.numpy(), dtype=np.float64)

    def encrypt_inputs(self, X: npt.ArrayLike, rolled: bool = False) -> Message:
        """An ``infer`` message: the batch (feature-major), with ``rolled`` its copies.

        ``rolled`` selects the non-interactive configuration (the server gets the n
        rolled copies up front and sends no requests).
        """
        X = self.check_inputs(X)
        n = self.model.config.n_tokens
        packed = pack(self.embed(X), self._slots)
        if rolled:
            packed = packed + [roll_tokens(p, n, s) for s in range(n) for p in packed]
        meta = {"interactive": not rolled, "sequences": int(X.shape[0])}
        return self._encrypt("infer", packed, meta)

    def encrypt_lora(self) -> Message:
        """The secret LoRA factors (and personal head), one ciphertext per entry."""
        factors = lora_factors(self.model)
        values = [np.full(self._slots, x) for M in factors.values() for x in M.ravel()]
        meta = {
            "names": list(factors),
            "shapes": [list(M.shape) for M in factors.values()],
        }
        return self._encrypt("lora", values, meta)

    def answer(self, request: Message) -> Message:
        """Serve one server request: ``refresh`` or ``roll`` (fresh encryptions).

        Raises
        ------
        ProtocolError
            For any other request, or a roll of a bad number of copies.
        """
        if not isinstance(request, Message):
            raise TypeError(f"request must be a Message, got {type(request).__name__}")
        if request.kind == "refresh":
            self.refreshes += 1
            self.refreshed += len(request.blobs)
            return self._encrypt("refreshed", self._decrypt(request))
        if request.kind == "roll":
            n = self.model.config.n_tokens
            copies = request.meta.get("copies")
            if isinstance(copies, bool) or not isinstance(copies, int):
                raise ProtocolError(
                    f"roll request: copies must be an int, not {copies!r}"
                )
            if not 1 <= copies <= n:
                raise ProtocolError(f"roll request: copies must be in [1, {n}]")
            self.refreshes += 1
            values = self._decrypt(request)
            self.refreshed += len(values)
            return self._encrypt(
                "rolled", [roll_tokens(v, n, s) for s in range(copies) for v in values]
            )
        raise ProtocolError(
            f"the client answers refresh and roll, not {request.kind!r}"
        )

    def decrypt_logits(self, message: Message, batch: int) -> FloatArray:
        """Decrypt the logits and read the CLS slot of each of ``batch`` sequences."""
        n = self.model.config.n_tokens
        if not isinstance(message, Message):
            raise TypeError(f"message must be a Message, got {type(message).__name__}")
        batch = check_int("batch", batch, 1, self._slots // n)
        if message.kind != "logits":
            raise ProtocolError(f"expected a logits message, got {message.kind!r}")
        if len(message.blobs) != self.model.config.n_classes:
            raise ProtocolError(
                f"expected {self.model.config.n_classes} logit ciphertexts, got "
                f"{len(message.blobs)}"
            )
        values = self._decrypt(message)
        return np.stack([v[: batch * n : n] for v in values], axis=1)

    def open(self, connection: Channel) -> None:
        """Start a session: send the public context and the encrypted LoRA factors."""
        for message in (
            Message("context", self.key, (self.public_context(),)),
            self.encrypt_lora(),
        ):
            data = message.encode()
            connection.send(data)
            self.setup_bytes += len(data)
        count("setup_bytes_up", self.setup_bytes)

    def infer(
        self, connection: Channel, X: FloatArray, interactive: bool
    ) -> FloatArray:
        """One packed batch over an open session; answers the server's requests."""
        data = self.encrypt_inputs(X, rolled=not interactive).encode()
        connection.send(data)
        up, down, trips = len(data), 0, 1
        while True:
            raw = connection.recv()
            down += len(raw)
            reply = Message.decode(raw)
            if reply.kind == "logits":
                break
            if reply.kind == "error":
                kind = ProtocolError if reply.meta.get("value_error") else RuntimeError
                raise kind(f"the server refused the request: {reply.meta.get('error')}")
            answer = self.answer(reply).encode()
            connection.send(answer)
            up, trips = up + len(answer), trips + 1
        counts = {str(k): int(v) for k, v in dict(reply.meta.get("counts", {})).items()}
        exchange = Exchange(
            X.shape[0], up, down, trips, float(reply.meta.get("seconds", 0.0)), counts
        )
        self.exchanges.append(exchange)
        for name, amount in (
            ("ciphertext_bytes_up", up),
            ("ciphertext_bytes_down", down),
            ("round_trips", trips),
            *counts.items(),
        ):
            count(name, amount)
        return self.decrypt_logits(reply, X.shape[0])

    def predict(
        self, server: Server | Channel, X: npt.ArrayLike, interactive: bool = True
    ) -> FloatArray:
        """Encrypted logits for ``X`` (batched to fill the slots).

        ``server`` is a :class:`Server` (served in-process for this call) or an open
        connection to one (:class:`InProcess`, :class:`~crypto.transport.Loopback`).
        """
        from .train import predict_logits

        X = self.check_inputs(X)
        predict_logits(self.model, X, guard=True)  # refuse before any upload
        per_batch = self._slots // self.model.config.n_tokens
        connection = InProcess(server) if isinstance(server, Server) else server
        try:
            self.open(connection)
            out = [
                self.infer(connection, X[start : start + per_batch], interactive)
                for start in range(0, X.shape[0], per_batch)
            ]
        finally:
            if isinstance(server, Server):
                assert isinstance(connection, InProcess)
                connection.close()
        return np.concatenate(out)


class Server:
    """The honest-but-curious server: public context and frozen plaintext weights.

    Parameters
    ----------
    context : bytes or None
        The client's public context (or None: it arrives in a ``context`` message).
    weights : HEWeights
        The public folded weights.
    params : CKKSParams
        The modulus chain the context was made with.

    Raises
    ------
    ValueError
        If the context holds a secret key or is not a TenSEAL context.
    """

    def __init__(self, context: bytes | None, weights: HEWeights, params: CKKSParams):
        if not isinstance(weights, HEWeights):
            raise TypeError(f"weights must be HEWeights, got {type(weights).__name__}")
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
        cls, context: bytes | None, model: HEFormer, params: CKKSParams
    ) -> Server:
        """A server for the public part of ``model``."""
        return cls(context, HEWeights.from_model(model), params)

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
            if message.kind == "close":
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
        if reply.kind == "close":
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
        if interactive:
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


class InProcess:
    """The default transport: the server in a thread of this process, bytes between.

    The server's thread sees only its end of two queues of byte strings. Within one
    process this is a discipline, not isolation (any code can walk the heap); use
    :class:`~crypto.transport.Loopback` for a process boundary.
    """

    def __init__(self, server: Server):
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
