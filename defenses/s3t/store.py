"""Atomic, checksummed state files.

A state file is ``MAGIC || SHA-256(payload) || payload`` where the payload is a
``torch.save`` of plain containers and tensors (loaded back with
``weights_only=True``, so a state file cannot run code). Writing goes to a temporary
file in the same directory, is flushed and fsynced, then renamed over the target
with :func:`os.replace`, which is atomic on POSIX: a crash leaves either the old file
or the new one, never a mix, and the old file (with any data it held) is gone once
the new one is in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch

MAGIC = b"S3TSTATE\x01"


class StateFileError(ValueError):
    """A state file is corrupted, truncated, or does not match the model."""


def encode(payload: dict[str, Any]) -> bytes:
    """Serialize ``payload`` with its checksum."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    return MAGIC + hashlib.sha256(body).digest() + body


def decode(blob: bytes, where: str) -> dict[str, Any]:
    """Check the magic and the checksum, then load the payload."""
    if not blob.startswith(MAGIC):
        raise StateFileError(f"{where} is not an S3T state file (bad magic bytes)")
    digest, body = blob[len(MAGIC) : len(MAGIC) + 32], blob[len(MAGIC) + 32 :]
    if len(digest) < 32 or hashlib.sha256(body).digest() != digest:
        raise StateFileError(f"{where} is corrupted or truncated (checksum mismatch)")
    try:
        payload = torch.load(io.BytesIO(body), weights_only=True)
    except Exception as error:
        raise StateFileError(f"{where} could not be decoded: {error}") from error
    if not isinstance(payload, dict):
        raise StateFileError(f"{where} does not hold a state dictionary")
    return payload


def write_atomic(path: str | os.PathLike[str], blob: bytes) -> None:
    """Write ``blob`` to ``path`` atomically (temporary file, fsync, rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("wb") as handle:
            handle.write(blob)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a state file."""
    target = Path(path)
    if not target.is_file():
        raise FileNotFoundError(f"no state file at {target}")
    return decode(target.read_bytes(), str(target))
