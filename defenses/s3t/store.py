"""Atomic, checksummed state files that leave no stale copy behind.

A state file is ``MAGIC || SHA-256(payload) || payload`` where the payload is a
``torch.save`` of plain containers and tensors (loaded back with
``weights_only=True``, so a state file cannot run code).

Writing (:func:`write_atomic`) goes to a temporary file in the same directory,
named ``.<name>.<pid>.<random>.s3t-tmp`` (:func:`temporary_files` finds them), which
the writer holds under an exclusive ``flock`` from creation to rename. The file is
flushed and fsynced, then renamed over the target with :func:`os.replace` (atomic
on POSIX: a crash leaves the old file or the new one, never a mix), and the
directory is fsynced. On every failure path that returns control (an exception, a
``KeyboardInterrupt``) the temporary file is removed before the error propagates.

A process killed between the write and the rename cannot clean up: its temporary
file, a complete copy of the state it was saving, stays behind. Every
:func:`write_atomic` and :func:`read` therefore first removes the temporary files
of its target that no live process holds (the kernel drops a dead process's
``flock``, whatever its pid is later reused for), so a deleted row does not survive
in a stale copy past the next save or load.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import torch

MAGIC = b"S3TSTATE\x01"
TEMP_SUFFIX = ".s3t-tmp"

logger = logging.getLogger(__name__)


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


def check_path(path: object, name: str = "path") -> str:
    """``path`` as a string, or raise TypeError naming ``name``."""
    try:
        return os.fspath(path)  # type: ignore[call-overload, no-any-return]
    except TypeError as error:
        raise TypeError(
            f"{name} must be a str or os.PathLike, got {type(path).__name__}"
        ) from error


def temporary_files(path: str | os.PathLike[str]) -> list[Path]:
    """The temporary files of ``path`` in its directory (live or stale)."""
    target = Path(path)
    if not target.parent.is_dir():
        return []
    return sorted(target.parent.glob(f".{target.name}.*{TEMP_SUFFIX}"))


def _fsync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def remove_stale(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files of ``path`` that no live process holds.

    A temporary file is in use while its writer holds an exclusive ``flock`` on it;
    a file whose lock can be taken belongs to a writer that died. Returns the files
    removed.
    """
    removed = []
    for candidate in temporary_files(path):
        try:
            handle = os.open(candidate, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(handle)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                continue
            raise
        try:
            with contextlib.suppress(FileNotFoundError):
                candidate.unlink()
                removed.append(candidate)
        finally:
            os.close(handle)
    if removed:
        logger.warning(
            "removed %d stale temporary state file(s) of %s left by a killed "
            "process: %s",
            len(removed),
            path,
            ", ".join(p.name for p in removed),
        )
        _fsync_directory(Path(path).parent)
    return removed


def _locked_temporary(target: Path) -> tuple[Path, int]:
    """Create and lock a fresh temporary file next to ``target``."""
    while True:
        name = f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        temporary = target.with_name(name)
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            same = os.stat(temporary).st_ino == os.fstat(handle).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return temporary, handle
        # a cleaner took the lock in the instant before ours and removed the file
        os.close(handle)


def write_atomic(path: str | os.PathLike[str], blob: bytes) -> None:
    """Write ``blob`` to ``path`` atomically, leaving no temporary file behind."""
    target = Path(check_path(path))
    if target.is_dir():
        raise ValueError(f"path {target} is a directory, not a state file")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target)
    temporary, handle = _locked_temporary(target)
    try:
        with os.fdopen(os.dup(handle), "wb") as stream:
            stream.write(blob)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise
    finally:
        os.close(handle)
    _fsync_directory(target.parent)


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a state file (after removing its stale temporary files)."""
    target = Path(check_path(path))
    remove_stale(target)
    if not target.is_file():
        raise FileNotFoundError(f"no state file at {target}")
    return decode(target.read_bytes(), str(target))
