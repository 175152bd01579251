"""First calls that do not wait for the compiler: a background process compiles.

A compiled kernel with no machine code cached for this machine and these argument
types used to compile in the call (20-40 s for the shield's kernels on an idle
2-core machine). :func:`pick` returns instead:

* the kernel, when its machine code is in memory or in a cache folder (loaded here,
  as numba's own dispatcher would load it: a fraction of a second);
* otherwise the kernel's numpy twin (:mod:`.plain`: the same answers, bit for bit,
  a few times slower), and a separate process, started once per kernel and types,
  compiles the kernel into the cache folder the caller reads
  (:func:`defenses.jit.cache_folders`). A process rather than a thread: numba's
  compiler is Python code and would hold the GIL that the caller's calls need. The
  next call after that process ends loads the machine code and uses the kernel.

One WARNING line says what is compiling, where, and that calls are answered by the
numpy path meanwhile. A lock file next to the cache entries (``*.compiling``, the
compiling process's id) keeps several processes that start cold together (server
workers, test runners) to one compilation per kernel and types; one left by a
process that died is taken over.

The kernel is compiled in the call (the previous behaviour, with its WARNING line)
when no cache folder is writable (a background process could not hand the code
over), when the background process failed, inside ``python -m defenses.jit``
(:func:`defenses.jit.warm`, which fills the cache ahead of time), and when
``DEFENSE_SUITE_JIT=inline`` is set.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from defenses import jit
from defenses.processes import pid_alive

logger = logging.getLogger(__name__)

MODE_ENV = "DEFENSE_SUITE_JIT"
"""``inline``: compile in the call; anything else (default): in the background."""
POLL_S = 0.25
"""Least time between two checks of a compilation another process holds."""
STALE_S = 900.0
"""A lock file older than this is taken over (a compilation never takes so long)."""

_READY: set[tuple[Any, ...]] = set()
_JOBS: dict[tuple[Any, ...], _Job] = {}
_LOCK = threading.Lock()


class _Job:
    """A compilation of one kernel and signature, ours (a process) or another's."""

    def __init__(self, lock: Path, process: subprocess.Popen[bytes] | None) -> None:
        self.lock = lock
        self.process = process
        self.checked = time.monotonic()
        self.done = False
        self.owner = os.getpid()

    def finished(self) -> bool:
        """Whether the compilation ended (the cache may then hold the code).

        A forked worker that inherited the job watches the lock file: the process
        is its parent's child, not its own.
        """
        if self.done:
            return True
        if self.process is not None and self.owner != os.getpid():
            self.process = None
        if self.process is not None:
            self.done = self.process.poll() is not None
        elif time.monotonic() - self.checked >= POLL_S:
            self.checked = time.monotonic()
            self.done = _holder(self.lock) is None
        return self.done

    def failed(self) -> bool:
        return self.process is not None and self.process.returncode != 0


def _holder(lock: Path) -> int | None:
    """The live process that holds ``lock`` (None if none, or the lock is stale)."""
    try:
        pid = int(lock.read_text() or "0")
        age = time.time() - lock.stat().st_mtime
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and pid_alive(pid) and age < STALE_S else None


def _arg_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What numba's dispatch reads of each argument, cheaply (no typeof)."""
    return tuple(
        (a.dtype.str, a.ndim, a.flags.c_contiguous, a.flags.writeable)
        if hasattr(a, "flags")
        else type(a)
        for a in args
    )


def _indexed(kernel: Any) -> bool:
    """Whether a cache folder holds an index of ``kernel`` (of any stamp).

    Loading from the cache first sets up numba's whole target context (its
    registries of numpy functions: about 1 s idle, 2.5 s at load 11), which a
    cold call that will not find anything need not pay.
    """
    cache = kernel._cache
    folders = jit.cache_folders(cache._source)[0]
    return any(os.path.exists(file._index_path) for file in cache._files(folders))


def _load(kernel: Any, sig: tuple[Any, ...]) -> bool:
    """Load ``kernel``'s machine code for ``sig`` from the cache, as numba does."""
    from numba.core.compiler_lock import global_compiler_lock

    with global_compiler_lock:
        if kernel.overloads.get(sig) is not None:
            return True
        if not _indexed(kernel):
            return False  # nothing cached: skip numba's context set-up (1-3 s)
        cres = kernel._cache.load_overload(sig, kernel.targetctx)
        if cres is None:
            return False
        kernel._cache_hits[sig] += 1
        kernel.targetctx.insert_user_function(
            cres.entry_point, cres.fndesc, [cres.library]
        )
        kernel.add_overload(cres)
    return True


def lock_path(kernel: Any, sig: tuple[Any, ...]) -> Path | None:
    """The lock file of ``kernel``'s compilation for ``sig`` (None: no folder)."""
    func = kernel.py_func
    folder = jit.cache_folders(func.__code__.co_filename)[1]
    if folder is None:
        return None
    digest = hashlib.sha256(repr((func.__qualname__, sig)).encode()).hexdigest()[:16]
    return folder / f"{func.__qualname__}-{digest}.compiling"


def _start(kernel: Any, sig: tuple[Any, ...]) -> _Job | None:
    """Start (or join) the compilation of ``kernel`` for ``sig`` (None: cannot)."""
    func = kernel.py_func
    lock = lock_path(kernel, sig)
    if lock is None:
        return None
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            if _holder(lock) is not None:
                return _Job(lock, None)
            lock.unlink(missing_ok=True)  # stale: its process is gone
            continue
        except OSError:
            return None
        break
    else:
        return _Job(lock, None)
    job = pickle.dumps(
        (func.__module__, func.__qualname__, sig, str(lock), list(sys.path))
    )
    root = str(Path(__file__).resolve().parents[3])  # the folder holding defenses/
    code = (
        f"import sys; sys.path.insert(0, {root!r}); "
        f"from {__name__} import _compile_job; raise SystemExit(_compile_job())"
    )
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert process.stdin is not None
        process.stdin.write(job)
        process.stdin.close()
    except OSError as error:
        os.close(fd)
        lock.unlink(missing_ok=True)
        logger.info("no background compilation (%s): compiling in the call", error)
        return None
    os.write(fd, str(process.pid).encode())
    os.close(fd)
    logger.warning(
        "compiling %s.%s for %s in a background process (pid %d; 10-60 s, once, "
        "cached in %s); until it is done these calls run SSD's numpy path (same "
        "answers, slower); `python -m defenses.jit` compiles ahead of time",
        func.__module__,
        func.__qualname__,
        sig[0] if sig else "()",
        process.pid,
        lock.parent,
    )
    return _Job(lock, process)


def _inline() -> bool:
    return os.environ.get(MODE_ENV, "") == "inline" or jit.compiling_in_call()


def pick(
    kernel: Any,
    fallback: Callable[..., Any],
    args: tuple[Any, ...],
    types: tuple[Any, ...] | None = None,
) -> Any:
    """``kernel`` if its machine code for ``args`` is at hand, else ``fallback``.

    ``fallback`` must return what ``kernel`` returns for every input (see
    :mod:`.plain`). See the module's docstring for when the kernel compiles.
    ``types``: what decides numba's types of ``args``, from a caller that builds
    them the same way every call (it must differ whenever those types do); read
    from ``args`` otherwise (2-3 us a call of 11 arguments).
    """
    key = (id(kernel), _arg_key(args) if types is None else types)
    if key in _READY:
        return kernel
    with _LOCK:
        if _inline():
            return kernel
        sig = tuple(kernel.typeof_pyval(a) for a in args)
        job = _JOBS.get((key, sig))
        if job is None:
            if _load(kernel, sig):
                _READY.add(key)
                return kernel
            job = _start(kernel, sig)
            if job is None:
                _READY.add(key)  # compiles in the call
                return kernel
            _JOBS[(key, sig)] = job
            return fallback
        if not job.finished():
            return fallback
        del _JOBS[(key, sig)]
        _READY.add(key)
        if _load(kernel, sig):
            logger.info("%s: compiled code loaded", kernel.py_func.__qualname__)
        elif job.failed():
            logger.warning(
                "background compilation of %s failed; compiling in the call",
                kernel.py_func.__qualname__,
            )
        return kernel


def wait(timeout: float = 600.0) -> bool:
    """Wait for this process's background compilations; whether all ended."""
    end = time.monotonic() + timeout
    for job in list(_JOBS.values()):
        while not job.finished():
            if time.monotonic() > end:
                return False
            time.sleep(0.05)
    return True


def _compile_job() -> int:
    """The background process: compile one kernel for one signature, then unlock."""
    module, qualname, sig, lock, paths = pickle.loads(sys.stdin.buffer.read())
    sys.path[:] = [*paths, *(p for p in sys.path if p not in paths)]
    try:
        if hasattr(os, "nice"):
            os.nice(5)
        kernel = importlib.import_module(module)
        for part in qualname.split("."):
            kernel = getattr(kernel, part)
        kernel.compile(sig)
    finally:
        Path(lock).unlink(missing_ok=True)
    return 0
