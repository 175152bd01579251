"""The bytes that cross between the HE client and server.

A :class:`Message` is a kind, the fingerprint of the public key its ciphertexts were
made under, a tuple of serialised TenSEAL objects (ciphertexts, or the public
context) and a small JSON header of public metadata. :meth:`Message.encode` lays it
out as

``MAGIC | u32 header length | header JSON | blob 1 | blob 2 | ...``

(the header lists the blob sizes), and :meth:`Message.decode` parses it back,
refusing anything malformed with a :class:`ValueError` that says what is wrong. Only
these bytes travel: the server never receives a Python object from the client.

Kinds, client to server: ``context`` (the public context), ``lora`` (the encrypted
secret factors), ``infer`` (an encrypted batch), ``train`` (an encrypted fine-tuning
batch, targets and weights), ``refreshed``, ``rolled`` and ``unrolled`` (answers),
``close``, and ``abort`` (the one reply to any request outside the public schedule of
:mod:`crypto.protocol.schedule`: empty, whatever was asked). Server to client:
``refresh``, ``roll`` and ``unroll`` (requests), ``logits`` and ``weights`` (the
answers), ``error``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Protocol

MAGIC = b"DSHE1"
KINDS = (
    "context",
    "lora",
    "infer",
    "train",
    "refreshed",
    "rolled",
    "unrolled",
    "close",
    "abort",
    "refresh",
    "roll",
    "unroll",
    "logits",
    "weights",
    "error",
)
_LENGTH = struct.Struct(">I")


class ProtocolError(ValueError):
    """The other party sent a message the protocol does not allow."""


class Channel(Protocol):
    """One end of an ordered, reliable exchange of byte strings."""

    def send(self, data: bytes) -> None:
        """Deliver ``data`` to the other end."""
        ...

    def recv(self) -> bytes:
        """The next byte string from the other end (blocks)."""
        ...


@dataclass(frozen=True)
class Message:
    """Serialised TenSEAL objects in transit, with public metadata.

    Parameters
    ----------
    kind : str
        One of :data:`KINDS`.
    key : str
        Fingerprint of the public key the ciphertexts were made under ("" when
        there are none).
    blobs : tuple of bytes
        Serialised ciphertexts (or, for ``context``, the public context).
    meta : dict
        JSON-serialisable public metadata (shapes, flags, operation counts).
    """

    kind: str
    key: str = ""
    blobs: tuple[bytes, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Message.kind must be one of {KINDS}, got {self.kind!r}")
        blobs = tuple(self.blobs)
        if not all(isinstance(b, bytes) for b in blobs):
            raise TypeError("Message.blobs must hold bytes only")
        object.__setattr__(self, "blobs", blobs)

    @property
    def nbytes(self) -> int:
        """Total size of the serialised objects."""
        return sum(len(b) for b in self.blobs)

    def encode(self) -> bytes:
        """The wire form."""
        header = json.dumps(
            {
                "kind": self.kind,
                "key": self.key,
                "sizes": [len(b) for b in self.blobs],
                "meta": self.meta,
            },
            allow_nan=False,
        ).encode()
        return b"".join((MAGIC, _LENGTH.pack(len(header)), header, *self.blobs))

    @classmethod
    def decode(cls, data: bytes) -> Message:
        """Parse the wire form; ValueError naming the defect if it is malformed."""
        if not isinstance(data, bytes):
            raise TypeError(f"message must be bytes, got {type(data).__name__}")
        start = len(MAGIC) + _LENGTH.size
        if len(data) < start or not data.startswith(MAGIC):
            raise ValueError("message: not a defense-suite HE message (bad magic)")
        (size,) = _LENGTH.unpack_from(data, len(MAGIC))
        if start + size > len(data):
            raise ValueError("message: truncated header")
        try:
            header = json.loads(data[start : start + size])
            kind, key = header["kind"], header["key"]
            sizes, meta = header["sizes"], header["meta"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"message: malformed header ({err})") from None
        if (
            not isinstance(sizes, list)
            or not all(isinstance(s, int) and s >= 0 for s in sizes)
            or not isinstance(meta, dict)
            or not isinstance(key, str)
            or not isinstance(kind, str)
        ):
            raise ValueError("message: malformed header fields")
        at = start + size
        if at + sum(sizes) != len(data):
            raise ValueError(
                f"message: the header announces {sum(sizes)} bytes of payload, "
                f"{len(data) - at} arrived (truncated or padded)"
            )
        blobs = []
        for s in sizes:
            blobs.append(data[at : at + s])
            at += s
        return cls(kind, key, tuple(blobs), meta)
