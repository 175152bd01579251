"""Compiled kernels: numba's ``njit``, cached on disk where any process can use it.

A kernel is written as a plain, typed Python function over numpy arrays and compiled
on first call (nopython mode, IEEE arithmetic: no ``fastmath``, so the order of every
sum is the one written). Compiling the suite's kernels takes tens of seconds on a
cold cache, so the machine code is kept on disk (:class:`KernelCache`) and later
processes load it in a fraction of a second:

* **where**: the first writable of the kernel's own ``__pycache__`` (a checkout, or
  an install made writable while ``python -m defenses.jit`` fills it), the user's
  cache (``$XDG_CACHE_HOME`` or ``~/.cache``, ``defense-suite/numba``) and a private
  folder in the temporary directory (``defense-suite-<uid>``, mode 0700). Every one
  of them that exists is read, so a cache built at install in a package folder that
  is read-only afterwards is still used. ``DEFENSE_SUITE_CACHE_DIR`` (or numba's
  ``NUMBA_CACHE_DIR``) replaces the list with one folder.
* **trust**: a cache file is a pickle, and loading one runs code. The user and
  temporary folders are used only if they belong to this user and no one else can
  write them (a folder planted by another user in ``/tmp`` is skipped).
* **freshness**: an entry's stamp hashes the source files of the kernel and of every
  kernel it calls or inlines, recursively, and the values of the module constants
  they read, so an edit to a helper in another file invalidates its callers (numba's
  own stamp covers the kernel's file only).

A package may answer a call whose kernel is not compiled yet from a numpy twin
with the same bits while a separate process compiles it (SSD does:
:mod:`defenses.ssd.kernels.background`); calls inside :func:`compile_in_call` (and
:func:`warm`) compile in the call. When a call has to compile (no cache entry for
this machine and these argument types), one line is logged (``logging.WARNING``,
so it reaches stderr without any logging set up) naming the kernel and the argument
types before the compiler starts, and the time it took when it ends.
``python -m defenses.jit`` compiles every kernel a call of the suite can need, ahead
of time (an install or image build step).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import stat
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import numba
import numpy as np
from numba.core.dispatcher import Dispatcher

from defenses.wide_vectors import PIPELINE

caching: Any = importlib.import_module("numba.core.caching")
event: Any = importlib.import_module("numba.core.event")

logger = logging.getLogger(__name__)

Kernel = TypeVar("Kernel", bound=Callable[..., object])

CACHE_ENV = "DEFENSE_SUITE_CACHE_DIR"
"""One folder for every cache entry (read and written), replacing the default list."""
WARMUPS = ("defenses.ssd.kernels.warmup", "defenses.rps.warmup")
"""Modules whose ``run()`` makes the calls that compile a package's kernels."""

_OURS: set[int] = set()
_STAMPS: dict[int, bytes] = {}
_depth = threading.local()


def _private(path: Path) -> bool:
    """Whether ``path`` is a folder of this user's that no one else can write."""
    try:
        info = path.stat()
    except OSError:
        return False
    uid = os.getuid() if hasattr(os, "getuid") else info.st_uid
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == uid
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _writable(path: Path) -> bool:
    """Whether a file can be created in ``path`` (made, mode 0700, if missing)."""
    try:
        missing = [p for p in (path, *path.parents) if not p.exists()]
        for folder in reversed(missing):
            folder.mkdir(mode=0o700, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def _numba_cache_dir() -> str:
    """The folder in ``NUMBA_CACHE_DIR`` (empty if unset)."""
    return str(getattr(numba.config, "CACHE_DIR", "") or "")


def _user_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return Path(base) / "defense-suite" / "numba"


def _temp_dir() -> str:
    """The temporary folder ("" where none is writable: gettempdir raises)."""
    try:
        return tempfile.gettempdir()
    except OSError:
        return ""


def _temp_root() -> Path | None:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    temp = _temp_dir()
    return Path(temp) / f"defense-suite-{uid}" / "numba" if temp else None


_FOLDERS: dict[tuple[str, ...], tuple[list[Path], Path | None]] = {}


def cache_folders(source: str) -> tuple[list[Path], Path | None]:
    """The folders read (in order) and the folder written for kernels of ``source``.

    See the module's docstring for the order and the trust rule. The written
    folder is None when none is writable (nothing is saved; calls still work).
    Found once per process for each source file and environment.
    """
    key = (
        source,
        os.environ.get(CACHE_ENV, ""),
        str(_numba_cache_dir()),
        os.environ.get("XDG_CACHE_HOME", ""),
        os.path.expanduser("~"),
        _temp_dir(),
    )
    if key not in _FOLDERS:
        _FOLDERS[key] = _find_folders(source)
    read, write = _FOLDERS[key]
    return list(read), write


def _find_folders(source: str) -> tuple[list[Path], Path | None]:
    source_dir = Path(source).resolve().parent
    explicit = os.environ.get(CACHE_ENV) or _numba_cache_dir()
    sub = caching._CacheLocator.get_suitable_cache_subpath(source)
    if explicit:
        folder = Path(explicit) / sub
        return [folder], folder if _writable(folder) else None
    in_tree = source_dir / "__pycache__"
    temp = _temp_root()
    private = [_user_root() / sub, *([temp / sub] if temp else [])]
    read = [in_tree] if in_tree.is_dir() else []
    write = in_tree if _writable(in_tree) else None
    for folder in private:
        if write is None and _writable(folder) and _trusted_chain(folder):
            write = folder
        if folder.is_dir() and _trusted_chain(folder) and folder not in read:
            read.append(folder)
    return read, write


def _trusted_chain(folder: Path) -> bool:
    """The folder and its parents up to ``defense-suite*`` are private (see above)."""
    for path in (folder, *folder.parents):
        if not _private(path):
            return False
        if path.name.startswith("defense-suite"):
            return True
    return False


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _stamp(function: Callable[..., Any]) -> bytes:
    """Hash of the kernel's sources, its callees' (recursively) and their constants."""
    digest = hashlib.sha256()
    seen: set[int] = set()
    files: set[str] = set()
    pending = [function]
    while pending:
        func = pending.pop()
        if id(func) in seen:
            continue
        seen.add(id(func))
        files.add(func.__code__.co_filename)
        names = sorted({n for c in _code_objects(func.__code__) for n in c.co_names})
        for name in names:
            value = func.__globals__.get(name)
            if isinstance(value, Dispatcher):
                pending.append(value.py_func)
            elif isinstance(value, np.ndarray):
                digest.update(f"{name}={value.dtype}{value.shape}".encode())
                digest.update(value.tobytes())
            elif isinstance(value, (bool, int, float, complex, str, tuple, np.generic)):
                digest.update(f"{name}={value!r}".encode())
    for name in sorted(files):
        digest.update(name.rsplit(os.sep, 1)[-1].encode())
        digest.update(Path(name).read_bytes())
    return digest.digest()


class _Locator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):  # type: ignore[misc]
    """Names the kernel's entries; the folders come from :func:`cache_folders`."""

    def __init__(self, py_func: Callable[..., Any], py_file: str) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno

    def get_cache_path(self) -> str:
        return str(cache_folders(self._py_file)[1] or "")

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> _Locator:
        return cls(py_func, py_file)


class _Impl(caching.CompileResultCacheImpl):  # type: ignore[misc]
    _locator_classes: ClassVar[list[type]] = [_Locator]


class KernelCache(caching.FunctionCache):  # type: ignore[misc]
    """numba's per-function cache, read from several folders, stamped by content.

    The stamp (:func:`_stamp`) is computed at the first load or save, when every
    module the kernel calls into has been imported.
    """

    _impl_class = _Impl

    def __init__(self, py_func: Callable[..., Any], tag: str = "") -> None:
        self._name = repr(py_func)
        self._tag = tag  # compile options that change the code: part of the stamp
        self._py_func = py_func
        self._impl = self._impl_class(py_func)
        self._source = self._impl.locator._py_file
        self._cache_path = ""
        self.enable()

    def _files(self, folders: list[Path]) -> list[caching.IndexDataCacheFile]:
        stamp = _STAMPS.get(id(self._py_func))
        if stamp is None:
            stamp = _stamp(self._py_func) + self._tag.encode()
            _STAMPS[id(self._py_func)] = stamp
        return [
            caching.IndexDataCacheFile(
                cache_path=str(folder),
                filename_base=self._impl.filename_base,
                source_stamp=stamp,
            )
            for folder in folders
        ]

    @property
    def cache_path(self) -> str:
        """The folder written (empty if none is writable)."""
        return str(cache_folders(self._source)[1] or "")

    def flush(self) -> None:
        """Empty the index of the written folder."""
        write = cache_folders(self._source)[1]
        if write is not None:
            self._files([write])[0].flush()

    def _load_overload(self, sig: Any, target_context: Any) -> Any:
        if not self._enabled:
            return None
        key = self._index_key(sig, target_context.codegen())
        for file in self._files(cache_folders(self._source)[0]):
            try:
                data = file.load(key)
            except Exception as error:  # a damaged entry: compile instead
                logger.info("ignoring a damaged kernel cache entry: %s", error)
                continue
            if data is not None:
                return self._impl.rebuild(target_context, data)
        return None

    def _save_overload(self, sig: Any, data: Any) -> None:
        write = cache_folders(self._source)[1]
        if not self._enabled or write is None or not self._impl.check_cachable(data):
            return
        key = self._index_key(sig, data.codegen)
        try:
            self._files([write])[0].save(key, self._impl.reduce(data))
        except OSError as error:
            logger.info("kernel cache not saved in %s: %s", write, error)


class _CompileNotice(event.Listener):  # type: ignore[misc]
    """Logs one line when a kernel of the suite starts compiling, one when done."""

    def on_start(self, ev: event.Event) -> None:
        dispatcher = ev.data["dispatcher"]
        depth = getattr(_depth, "value", 0)
        _depth.value = depth + 1
        if depth or id(dispatcher.py_func) not in _OURS:
            return
        _depth.start = time.perf_counter()
        func = dispatcher.py_func
        first = ev.data["args"][0] if ev.data["args"] else ""
        write = cache_folders(func.__code__.co_filename)[1]
        logger.warning(
            "compiling %s.%s for %s: first call with these types on this machine "
            "(once, under a second to a minute; cached in %s; "
            "`python -m defenses.jit` compiles ahead of time)",
            func.__module__,
            func.__qualname__,
            first,
            write or "no writable folder: not cached",
        )

    def on_end(self, ev: event.Event) -> None:
        _depth.value = getattr(_depth, "value", 1) - 1
        if _depth.value == 0 and id(ev.data["dispatcher"].py_func) in _OURS:
            func = ev.data["dispatcher"].py_func
            took = time.perf_counter() - getattr(_depth, "start", time.perf_counter())
            logger.info("compiled %s in %.1f s", func.__qualname__, took)


event.register("numba:compile", _CompileNotice())


def _njit(function: Kernel, wide: bool = False, **options: Any) -> Kernel:
    tag = ""
    if wide and PIPELINE is not None:
        options["pipeline_class"], tag = PIPELINE, "wide"
    dispatcher = numba.njit(nogil=True, **options)(function)
    dispatcher._cache = KernelCache(function, tag)  # what cache=True does, our class
    _OURS.add(id(function))
    return cast(Kernel, dispatcher)


def compiled(function: Kernel) -> Kernel:
    """Compile ``function`` with numba (nopython, cached, releasing the GIL)."""
    return _njit(function)


def inlined(function: Kernel) -> Kernel:
    """Compile a helper of kernels, inlined into each caller.

    A call between compiled functions passes every array as a reference-counted
    structure; for small helpers called per element that bookkeeping costs more
    than their arithmetic.
    """
    return _njit(function, inline="always")


def vectorizable(function: Kernel, inline: bool = False, wide: bool = False) -> Kernel:
    """:func:`compiled` (or :func:`inlined`) with numpy's error model.

    Under Python's error model every float division tests its divisor for zero and
    raises, a branch per element that keeps the compiler from vectorizing a loop;
    under numpy's a zero divisor gives inf or NaN, which the callers' checks catch.
    ``wide``: 512-bit vectors where the CPU has them (:mod:`defenses.wide_vectors`).
    """
    if inline:
        return _njit(function, wide, error_model="numpy", inline="always")
    return _njit(function, wide, error_model="numpy")


_in_call = threading.local()


def compiling_in_call() -> bool:
    """Whether calls compile their kernels themselves (inside :func:`warm`).

    Outside it, a package may answer a call whose kernel is not compiled yet from
    a numpy twin while another process compiles (``defenses.ssd.kernels.background``).
    """
    return bool(getattr(_in_call, "value", False))


@contextlib.contextmanager
def compile_in_call() -> Iterator[None]:
    """Within this block (this thread), calls compile their kernels themselves.

    For what measures the compiled kernels (a benchmark's warm-up, a memory test)
    and for :func:`warm`.
    """
    previous = compiling_in_call()
    _in_call.value = True
    try:
        yield
    finally:
        _in_call.value = previous


def warm(modules: tuple[str, ...] = WARMUPS) -> dict[str, float]:
    """Compile (or load) every kernel the suite's calls need; seconds per module.

    Each module's ``run()`` makes representative calls (every dtype and kernel
    path), which compile in the call (:func:`compile_in_call`); a module that
    does not exist is skipped.
    """
    with compile_in_call():
        return _warm(modules)


def _warm(modules: tuple[str, ...]) -> dict[str, float]:
    took = {}
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is not None and name.startswith(error.name):
                logger.info("no warm-up module %s", name)
                continue
            raise
        start = time.perf_counter()
        module.run()
        took[name] = time.perf_counter() - start
    return took


def main(argv: list[str] | None = None) -> int:
    """``python -m defenses.jit``: compile ahead of time, print where and how long."""
    del argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # run as ``-m``, this file is ``__main__``; the kernels read the flag of
    # ``compile_in_call`` in the module ``defenses.jit``, so its ``warm`` runs
    module: Any = importlib.import_module("defenses.jit")
    for name, seconds in module.warm().items():
        folder = cache_folders(importlib.import_module(name).__file__ or "")[1]
        sys.stdout.write(f"{name}: {seconds:.1f} s (cache: {folder})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
