"""Encrypted inference between a key-holding client and a public-context server.

The client (Rho et al., 2025, Fig. 1) embeds its sequences with the public embedding,
encrypts them in the feature-major layout of :mod:`crypto.he.packing` together with its
secret LoRA factors, and sends only bytes (:class:`~crypto.protocol.wire.Message`). The
server holds the frozen plaintext weights and, once the client has sent it, the
public context (no secret key); it evaluates the layer and answers encrypted logits.
Without bootstrapping (TenSEAL has none) the server *asks* the client, by a
``refresh`` or ``roll`` message that the client answers, for refreshes (decrypt and
re-encrypt, counted as bootstrap stand-ins) and for the rolled copies of K and V
(the interactive configuration), or runs the whole layer in a larger ring from
client-rolled inputs (the non-interactive configuration).

Trust boundary: :meth:`Server.serve` reads and writes byte strings on a
:class:`~crypto.protocol.wire.Channel` and never holds a reference to a :class:`Client`,
a private context or a secret key. :class:`InProcess` (the default transport) runs it in
a thread of this process behind two queues of bytes; :mod:`crypto.protocol.transport`
runs it in another process over a loopback socket, so the boundary is a process
boundary. Every message the server receives is kept in its :class:`Transcript`; the
audit of :mod:`crypto.attacks` checks it holds only the public context and ciphertexts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_int
from defenses.cost import count

from ..he.ckks import CKKSParams, fingerprint, make_context, public_bytes
from ..he.packing import pack, roll_tokens
from ..program.heformer import lora_factors
from ..program.shadow import flag_sequences, report
from ..tasks import check_sequences
from .schedule import ANSWERS, Schedule, Step, calibrate, exceeds, inference_schedule
from .server import InProcess, Server, Transcript, hosted
from .session import Refused, abort, admit, follow, opened
from .timing import Floor, check_floor, pad, resolve_floor, units
from .wire import Channel, Message, ProtocolError

if TYPE_CHECKING:
    from ..models.heformer import HEFormer

__all__ = [
    "Client",
    "Exchange",
    "InProcess",
    "Message",
    "ProtocolError",
    "Refused",
    "Schedule",
    "Server",
    "Transcript",
]


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
    calibration : array-like or None
        Public calibration sequences: each refresh and roll then clips to
        ``margin`` x the magnitude seen there on them (:func:`crypto.protocol.schedule.
        calibrate`), and a batch whose own values would exceed it is refused
        before upload. Without it the clip bound is the chain's encoding-safe
        magnitude (:func:`crypto.protocol.schedule.safe_bound`).

    answer_floor : float or "auto"
        Seconds per unit (:mod:`crypto.protocol.timing`: one decryption and one
        encryption) that every answer to a refresh or roll, and the decryption of
        the logits, is padded to; 0: no padding; ``"auto"`` (default): twice the
        slowest unit of the client's own worst case, measured once when the first
        session opens. Below the floor, the answer's timing shows nothing of the
        plaintext; an overrun shows its excess.

    Attributes
    ----------
    decryptions : int
        Ciphertexts decrypted so far (a refused request adds none).
    clipped : int
        Decrypted slots the public bounds changed (0 in an honest run).
    flagged : ndarray of bool
        The advisory range verdict of the last :meth:`predict` (or
        :meth:`infer`), one per sequence
        (:mod:`crypto.program.shadow`): True where the plaintext shadow left the
        calibrated ranges, so the encrypted logits may be wrong. It never changes
        what the client sends; acting on it where the server can see is acting
        on a decryption (see the IND-CPA^D rules in ``docs/crypto.md``).

    Notes
    -----
    The client's rule: every message it sends (kind, count, size, timing class)
    and every refusal depends only on public values (the schedule, the model's
    shape, the calibration ranges, the floor, what the server sent) and on the
    caller's own arguments' shapes and finiteness, never on a decryption or on
    weights a server influenced.
    """

    def __init__(
        self,
        model: HEFormer,
        params: CKKSParams,
        calibration: npt.ArrayLike | None = None,
        answer_floor: Floor = "auto",
    ):
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
        self.decryptions = 0
        self.clipped = 0
        self.answer_floor = check_floor(answer_floor)
        self.flagged = np.zeros(0, dtype=np.bool_)
        self.setup_bytes = 0
        self.exchanges: list[Exchange] = []
        self._schedules: dict[bool, Schedule] = {}
        if calibration is not None:
            self._schedules[True] = calibrate(
                self.schedule(True), model, self.check_inputs(calibration)
            )

    def schedule(self, interactive: bool) -> Schedule:
        """The public schedule of one inference (derived once, then cached).

        Raises
        ------
        DepthError
            For a non-interactive session on a chain too short for the layer.
        """
        mode = bool(interactive)
        if mode not in self._schedules:
            self._schedules[mode] = inference_schedule(
                self.model, self.params, mode, self._slots
            )
        return self._schedules[mode]

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

    def _open(self, step: Step, message: Message) -> list[FloatArray]:
        """Admit ``message`` as ``step`` (before decrypting), then decrypt and clip."""
        vectors = admit(step, message, self.context, self.key, self.params)
        self.decryptions += len(vectors)
        out, changed = opened(vectors, step.bounds)
        self.clipped += changed
        return out

    def check_inputs(self, X: npt.ArrayLike) -> FloatArray:
        """``X`` as float64 sequences of the model's shape, finite, at least one."""
        c = self.model.config
        return check_sequences(X, c.n_tokens, c.token_dim)

    def embed(self, X: npt.ArrayLike, guard: bool = True) -> FloatArray:
        """Public embedding z = x W_e + P, after the range guard on the plaintext.

        ``guard=False`` leaves the range verdict to :meth:`predict`'s advisory
        check (the session path: a refusal there would depend on the weights).
        """
        import torch

        from ..models.train import predict_logits

        X = self.check_inputs(X)
        if guard:
            predict_logits(self.model, X, guard=True)
        with torch.no_grad():
            z = self.model.embed_tokens(torch.as_tensor(X, dtype=torch.float64))
        return np.asarray(z.numpy(), dtype=np.float64)

    def encrypt_inputs(
        self, X: npt.ArrayLike, rolled: bool = False, *, guard: bool = True
    ) -> Message:
        """An ``infer`` message: the batch (feature-major), with ``rolled`` its copies.

        ``rolled`` selects the non-interactive configuration (the server gets the n
        rolled copies up front and sends no requests); ``guard`` as for
        :meth:`embed`.
        """
        X = self.check_inputs(X)
        n = self.model.config.n_tokens
        packed = pack(self.embed(X, guard), self._slots)
        if rolled:
            packed = packed + [roll_tokens(p, n, s) for s in range(n) for p in packed]
        meta = {"interactive": not rolled, "sequences": int(X.shape[0])}
        return self._encrypt("infer", packed, meta)

    def secret_factors(self) -> dict[str, FloatArray]:
        """The secret LoRA factors (and personal head) by name."""
        return lora_factors(self.model)

    def encrypt_lora(self) -> Message:
        """The secret factors of :meth:`secret_factors`, one ciphertext per entry."""
        factors = self.secret_factors()
        values = [np.full(self._slots, x) for M in factors.values() for x in M.ravel()]
        meta = {
            "names": list(factors),
            "shapes": [list(M.shape) for M in factors.values()],
        }
        return self._encrypt("lora", values, meta)

    def answer(self, request: Message, step: Step) -> Message:
        """Serve one server request that must be ``step`` of the public schedule.

        The request is admitted (kind, count, copies, slots, level, scale) before
        anything is decrypted; the decrypted values are clipped to the step's
        public bounds and re-encrypted fresh (level 0), so the answer takes the
        same path whatever the plaintext.

        Raises
        ------
        Refused
            If the request is not ``step`` (nothing was decrypted).
        """
        if not isinstance(request, Message):
            raise TypeError(f"request must be a Message, got {type(request).__name__}")
        start = time.perf_counter()
        floor = self.floor()
        values = self._open(step, request)
        self.refreshes += 1
        self.refreshed += len(values)
        if step.kind == "roll":
            n = self.model.config.n_tokens
            values = [roll_tokens(v, n, s) for s in range(step.copies) for v in values]
        reply = self._encrypt(ANSWERS[step.kind], values)
        # pad to the public floor: the answer's time then shows nothing below it
        pad(start, floor, units(step, len(values)))
        return reply

    def floor(self) -> float:
        """Seconds per unit answers are padded to (``"auto"`` measured once here).

        The measurement answers the client's own public worst case
        (:func:`crypto.protocol.timing.resolve_floor`) and leaves the counters as they
        were.
        """
        return resolve_floor(self, self._slots)

    def decrypt_logits(
        self, message: Message, batch: int, interactive: bool = True
    ) -> FloatArray:
        """Check the logits reply's shape and level, decrypt, read the CLS slots.

        Raises
        ------
        Refused
            If the message is not ``n_classes`` ciphertexts of the agreed slots at
            the level the schedule's last stage leaves (checked before decryption).
        """
        n = self.model.config.n_tokens
        if not isinstance(message, Message):
            raise TypeError(f"message must be a Message, got {type(message).__name__}")
        batch = check_int("batch", batch, 1, self._slots // n)
        start, floor = time.perf_counter(), self.floor()
        reply = self.schedule(interactive).reply
        values = self._open(reply, message)
        pad(start, floor, len(reply.levels))  # as long whatever the logits
        return np.stack([v[: batch * n : n] for v in values], axis=1)

    def open(self, connection: Channel) -> None:
        """Start a session: send the public context and the encrypted LoRA factors."""
        self.floor()  # measured before the session, from public values only
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
        """One packed batch over an open session; answers the server's requests.

        :attr:`flagged` is left holding the batch's advisory verdict against a
        calibrated schedule's clip bounds (:func:`crypto.protocol.schedule.exceeds`).
        """
        schedule = self.schedule(interactive)
        over = interactive and exceeds(schedule, self.model, X)
        self.flagged = np.full(X.shape[0], over, dtype=np.bool_)
        data = self.encrypt_inputs(X, rolled=not interactive, guard=False).encode()
        return self._exchange(connection, schedule, data, X.shape[0], interactive)

    def _exchange(
        self,
        connection: Channel,
        schedule: Schedule,
        data: bytes,
        batch: int,
        interactive: bool,
    ) -> FloatArray:
        """Send ``data`` (an ``infer`` message), answer ``schedule``, open the logits.

        Records the :class:`Exchange` and counts its traffic; a refused reply ends
        the session with the empty ``abort``.
        """
        session = follow(connection, schedule, data, self.answer)
        reply, up, down = session.reply, session.bytes_up, session.bytes_down
        trips = session.round_trips
        try:
            logits = self.decrypt_logits(reply, batch, interactive)
        except Refused as err:
            abort(connection, err)
        counts = {str(k): int(v) for k, v in dict(reply.meta.get("counts", {})).items()}
        exchange = Exchange(
            batch, up, down, trips, float(reply.meta.get("seconds", 0.0)), counts
        )
        self.exchanges.append(exchange)
        for name, amount in (
            ("ciphertext_bytes_up", up),
            ("ciphertext_bytes_down", down),
            ("round_trips", trips),
            *counts.items(),
        ):
            count(name, amount)
        return logits

    def predict(
        self, server: Server | Channel, X: npt.ArrayLike, interactive: bool = True
    ) -> FloatArray:
        """Encrypted logits for ``X`` (batched to fill the slots).

        ``server`` is a :class:`Server` (served in-process for this call) or an open
        connection to one (:class:`InProcess`,
        :class:`~crypto.protocol.transport.Loopback`). Bad input (shape, NaN) is refused
        before anything is sent; the range guard is advisory (:attr:`flagged`, logged):
        every batch is sent the same way whatever its verdict, since the verdict depends
        on the weights, which an encrypted fine-tuning step lets the server influence.
        """
        X = self.check_inputs(X)  # bad input is refused before any upload
        flags = flag_sequences(self.model, X)  # advisory: changes no message
        per_batch = self._slots // self.model.config.n_tokens
        with self.connected(server) as connection:
            out = []
            for start in range(0, X.shape[0], per_batch):
                batch = X[start : start + per_batch]
                out.append(self.infer(connection, batch, interactive))
                flags[start : start + per_batch] |= self.flagged
        self.flagged = report(flags, "sequences")
        return np.concatenate(out)

    @contextlib.contextmanager
    def connected(self, server: Server | Channel) -> Iterator[Channel]:
        """An opened session with ``server`` for one call.

        A :class:`Server` is served in-process (:class:`InProcess`) and closed when
        the call ends, however it ends; an open connection is used as it is.
        """
        with hosted(server) as connection:
            self.open(connection)
            yield connection
