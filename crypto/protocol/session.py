r"""The client's side of a session: admit each request before decrypting, clip, abort.

:func:`admit` checks a server message against the
:class:`~crypto.protocol.schedule.Step` it must be (kind, key, count, copies, slot
count, level, polynomial count, scale) reading only what the server sent; :func:`clip`
bounds decrypted slots to the step's public bound so every re-encoding succeeds the same
way; :func:`abort` sends the one content-independent refusal; :func:`follow` walks a
session's schedule. Used by the inference client (:mod:`crypto.protocol.client`) and the
fine-tuning key owner (:mod:`crypto.protocol.tuning_client`).

The threat is a malicious server without integrity: it chooses every message, can
compute any function of the client's encrypted secrets and time every answer. The
client's rule, which this module and :mod:`crypto.program.bounds`,
:mod:`crypto.program.shadow` and :mod:`crypto.protocol.timing` enforce by construction:
every message the client sends (kind, count, ciphertext shapes, timing class) and every
refusal depends only on public values (the schedule, the model's shape, the calibration
ranges, the update bounds, the answer floor, what the server sent) and on the shapes and
finiteness of the caller's own arguments, never on a decrypted value or on weights a
server influenced. Refusals here read only what the server sent; a decrypted value is
only clipped, re-encrypted and padded; a returned update is bounded before use; a range
check after it is advisory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from defenses.arrays import FloatArray

from ..he.ckks import CKKSParams, load_ciphertext
from .schedule import Schedule, Step
from .wire import Channel, Message, ProtocolError

logger = logging.getLogger(__name__)


class Refused(ProtocolError):
    """A server message outside the public schedule (refused before decryption)."""


def admit(
    step: Step,
    message: Message,
    context: Any,
    key: str,
    params: CKKSParams,
    slots: int = 0,
) -> list[Any]:
    """Check a request against its step *before* decryption; the parsed ciphertexts.

    A step size of 0 admits one slot (a TenSEAL slot sum) or ``slots``.

    Raises
    ------
    Refused
        Naming the first deviation (kind, key, count, copies, slot count, level,
        polynomial count or scale). Parsing and these checks read only what the
        server sent, so the refusal depends on nothing secret.
    """
    if message.kind != step.kind:
        raise Refused(
            f"expected a {step.kind!r} message ({step.stage}), got {message.kind!r}"
        )
    if message.key != key:
        raise Refused("ciphertexts were made under another key")
    if len(message.blobs) != len(step.levels):
        raise Refused(
            f"{step.stage}: expected {len(step.levels)} ciphertexts, got "
            f"{len(message.blobs)}"
        )
    if step.kind in ("roll", "unroll"):
        copies = message.meta.get("copies")
        if copies != step.copies or isinstance(copies, bool):
            raise Refused(f"{step.stage}: copies must be {step.copies}, not {copies!r}")
    out = []
    for i, (blob, level, size) in enumerate(
        zip(message.blobs, step.levels, step.sizes, strict=True)
    ):
        what = f"{step.stage} ciphertext {i}"
        try:
            vec = load_ciphertext(context, blob, what, size or None)
        except ValueError as err:
            raise Refused(str(err)) from None
        if not size and vec.size() not in (1, slots):
            raise Refused(f"{what}: {vec.size()} slots, not 1 or {slots}")
        ct = vec.data.ciphertext()[0]
        # at least as deep as agreed: a deeper ciphertext has a smaller modulus,
        # hence smaller plaintexts (TenSEAL's in-place modulus switching can leave
        # an honest operand deeper than the program's count)
        primes = params.levels + 1 - level
        if not 1 <= ct.coeff_modulus_size() <= primes or ct.size() != 2:
            raise Refused(
                f"{what}: expected at most {primes} primes (level {level}) and 2 "
                f"polynomials, got {ct.coeff_modulus_size()} and {ct.size()}"
            )
        if abs(math.log2(ct.scale) - params.scale_bits) > 1.0:
            raise Refused(f"{what}: scale 2^{math.log2(ct.scale):.1f} is not agreed")
        out.append(vec)
    return out


def clip(values: FloatArray, bound: float) -> FloatArray:
    """Decrypted slots clipped to [-bound, bound] (NaN to 0): always encodable.

    The same operations run whatever the values, so the answer neither fails nor
    branches on the plaintext.
    """
    out: FloatArray = np.clip(
        np.nan_to_num(values, nan=0.0, posinf=bound, neginf=-bound), -bound, bound
    )
    return out


def opened(
    vectors: list[Any], bounds: tuple[float, ...], slots: int = 0
) -> tuple[list[FloatArray], int]:
    """Admitted ciphertexts decrypted and clipped (:func:`clip`); slots clipped.

    With ``slots``, a one-slot value (a TenSEAL slot sum) is replicated to
    ``slots``: every answer then has the same shape whatever the plaintext.
    """
    out, changed = [], 0
    for v, bound in zip(vectors, bounds, strict=True):
        plain = np.asarray(v.decrypt(), dtype=np.float64)
        clipped = clip(plain, bound)
        changed += int(np.count_nonzero(clipped != plain))
        out.append(
            clipped
            if not slots or clipped.size == slots
            else np.full(slots, clipped[0])
        )
    return out, changed


def abort(connection: Channel, err: Refused) -> NoReturn:
    """Send the one content-independent refusal (an empty ``abort``), raise ``err``."""
    logger.info("refused a server message: %s", err)
    connection.send(Message("abort").encode())
    raise err


@dataclass(frozen=True)
class Session:
    """The final reply of a followed session and its traffic."""

    reply: Message
    bytes_up: int
    bytes_down: int
    round_trips: int


def follow(
    connection: Channel,
    schedule: Schedule,
    first: bytes | Callable[[], bytes],
    answer: Callable[[Message, Step], Message],
) -> Session:
    """Send ``first``, answer the server's requests step by step, return its reply.

    ``first`` may be a function making the first message, called once: its bytes
    are then dropped once sent, where bytes passed in stay alive with the caller
    (a fine-tuning upload is every trained weight, encrypted). Each message is
    dropped once sent or parsed, so the session holds no copy of what is in
    transit beside the ciphertexts in use.

    The ``k``-th request is answered only as ``schedule.steps[k]``; a request
    beyond the schedule, a reply before its end, a malformed message or a
    request ``answer`` refuses all end the session with :func:`abort`.

    Raises
    ------
    Refused
        For any deviation from the schedule (nothing of it was decrypted).
    ProtocolError, RuntimeError
        When the server reports an error (bad input or a failure of its own).
    """
    data = first() if callable(first) else first
    connection.send(data)
    up, down, trips, served = len(data), 0, 1, 0
    del data, first
    while True:
        raw = connection.recv()
        down += len(raw)
        try:
            message = Message.decode(raw)
        except ValueError as err:
            abort(connection, Refused(f"malformed server message ({err})"))
        del raw
        if message.kind == "error":
            kind = ProtocolError if message.meta.get("value_error") else RuntimeError
            raise kind(f"the server refused the request: {message.meta.get('error')}")
        if message.kind == schedule.reply.kind and served == schedule.requests:
            return Session(message, up, down, trips)
        if served == schedule.requests:
            abort(
                connection,
                Refused(
                    f"request {served + 1} ({message.kind!r}) is beyond the public "
                    f"schedule of {schedule.requests} requests"
                ),
            )
        try:
            out = answer(message, schedule.steps[served]).encode()
        except Refused as err:
            abort(connection, err)
        del message
        served += 1
        connection.send(out)
        up, trips = up + len(out), trips + 1
        del out
