"""Results files that survive failures: write aside, rename at the end.

``run --out F`` writes every record to a temporary file beside ``F``
(``.F.<pid>.tmp``) and renames it over ``F`` only when the whole run succeeded
(:func:`os.replace` is atomic on one file system), so a run that fails or is
interrupted leaves ``F`` as it was. With ``--append`` or ``--resume`` the temporary
file starts as a byte-for-byte copy of ``F``.

Ctrl-C: :func:`interrupt_watch` installs a SIGINT handler that remembers the
interrupt before raising :class:`KeyboardInterrupt`. Some libraries catch that
exception and carry on (scikit-learn's MLP prints "Training interrupted by user" and
returns a part-trained model); the remembered interrupt is raised again when the
game returns, so its result is never recorded.

Every path is checked before a run starts (:func:`check_output`: a folder, a file
in the way, a folder that cannot be written) and every error names the path the
user gave, never the temporary file. :func:`read_results` reads results files,
naming the file and line of any line that is not UTF-8 text or not a result
record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import FrameType

from defenses.processes import pid_alive
from defenses.results import Result, read_jsonl

logger = logging.getLogger(__name__)


def temporary_path(path: Path) -> Path:
    """The temporary file this process writes for ``path``."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def remove_stale(path: Path) -> list[Path]:
    """Remove temporary files for ``path`` left by processes no longer running."""
    removed = []
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        pid = stale.name[len(path.name) + 2 : -len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)
            removed.append(stale)
    return removed


def check_output(path: Path, flag: str = "--out") -> None:
    """Refuse an output path that cannot be a results file, naming ``flag``."""
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, not a results file")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")
    try:  # the only sure test of writing there (permissions, read-only mounts, root)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as error:
        raise ValueError(
            f"{flag} {path}: cannot write in {parent} ({error.strerror})"
        ) from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: the file is not writable")


def read_results(*paths: str | Path) -> list[Result]:
    """Read results files (JSON Lines), naming file and line of a bad line.

    Raises
    ------
    ValueError
        ``FILE:LINE: ...`` when a line is not UTF-8 text or not a result record, or
        naming the path when it is not a readable file.
    """
    for path in map(Path, paths):
        if not path.is_file():
            continue  # read_jsonl names it
        with path.open("rb") as handle:
            for number, raw in enumerate(handle, 1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise ValueError(
                        f"{path}:{number}: not UTF-8 text (byte "
                        f"{raw[error.start]:#04x} at column {error.start + 1}); a "
                        "results file holds JSON Lines written by defense-suite run"
                    ) from None
    return read_jsonl(*paths)


def write_results(
    path: Path, results: Iterable[Result], keep_existing: bool = False
) -> int:
    """Write ``results`` to ``path`` through a temporary file; return how many.

    With ``keep_existing`` the records already in ``path`` come first, unchanged.
    On any exception (``KeyboardInterrupt`` included) the temporary file is removed
    and ``path`` is left as it was.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path)
    except OSError as error:
        raise ValueError(f"{path}: cannot write there ({error.strerror})") from None
    temporary = temporary_path(path)
    written = 0
    try:
        try:
            handle = temporary.open("w", encoding="utf-8")
        except OSError as error:
            raise ValueError(
                f"{path}: cannot write the results file ({error.strerror})"
            ) from None
        with handle:
            if keep_existing and path.exists():
                existing = path.read_text(encoding="utf-8")
                handle.write(existing)
                if existing and not existing.endswith("\n"):
                    handle.write("\n")
            for result in results:
                handle.write(json.dumps(result.to_dict(), sort_keys=True) + "\n")
                written += 1
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.replace(temporary, path)
        except OSError as error:
            raise ValueError(
                f"{path}: cannot replace the results file ({error.strerror})"
            ) from None
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return written


@contextlib.contextmanager
def interrupt_watch() -> Iterator[Callable[[], None]]:
    """Remember every SIGINT; yield a check that raises if one arrived.

    Outside the main thread (where signal handlers cannot be set) the check never
    raises and Python's default handling applies.
    """
    seen: list[int] = []

    def check() -> None:
        if seen:
            raise KeyboardInterrupt("interrupted (Ctrl-C)")

    if threading.current_thread() is not threading.main_thread():
        yield check
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        raise KeyboardInterrupt("interrupted (Ctrl-C)")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)
