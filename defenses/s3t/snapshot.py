r"""Snapshots of every piece of state a forward pass or a training step can move.

S3T's exactness needs a backbone that nothing writes to: a retrained model equals a
fresh fit only if every stage starts from the same frozen module. A snapshot is a
flat mapping ``path -> token`` (tokens compare equal iff the state is equal: tensors
and arrays by dtype, shape and SHA-256 of their bytes, floats by ``float.hex``, so
``NaN`` equals ``NaN``), built by walking, recursively:

* **own state** (the private deep copy S3T trains around): every parameter and
  buffer (persistent or not), and ``vars(module)`` of every submodule (private
  attributes included; only ``nn.Module``'s own bookkeeping dictionaries are left
  out), through lists, tuples, dicts, sets, ``functools.partial``, bound methods and
  plain objects (their ``__dict__`` and ``__slots__``), to numbers, strings, tensors,
  arrays and generators;
* **shared state** (reachable from the copy but shared with the rest of the
  process): the hooks registered on each submodule and torch's global module hooks
  (their closures, defaults and ``__self__``), the class attributes of every
  module class defined outside installed packages, the closure cells, default
  arguments and the module-level globals named by the code of those classes'
  methods and hooks (recursively through the functions they call that are
  defined outside installed packages), and the global random generators (torch's,
  numpy's legacy one, Python's ``random``).

``functools.lru_cache`` wrappers are compared by their cache size (a memo that
grows in forward is state) and their wrapped function is scanned; objects we
cannot look into (C objects, library objects reached from a global) by identity
and by their ``repr`` where it shows state rather than an address
(``itertools.count(5)``).

Out of reach, by design: code and globals of installed packages (torch,
transformers, ...: their instance state on the copy *is* walked), state held in C
extensions whose ``repr`` does not show it, files or other processes, and objects
nested more than :data:`MAX_DEPTH` levels (their identity is compared, not their
contents).
Aliases (one object at two paths) and cycles are recorded as references to the
first path, so the walk is finite.

The storages of every tensor found are kept as well (:attr:`Snapshot.storages`),
so that :mod:`defenses.s3t.conformance` can name the tensor an in-place operation
writes to, even when the write leaves its value unchanged on the probe batch.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import random
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_globals

MAX_DEPTH = 12
"""Containers and objects deeper than this are compared by identity."""

_MODULE_KEYS = frozenset(vars(nn.Module()))
"""``nn.Module``'s own bookkeeping (walked separately or not state)."""
_HOOK_KEYS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)
_LIBRARY_ROOTS = tuple(
    str(Path(p).resolve())
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_paths().get(key))
)

Token = tuple[object, ...]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_token(t: Tensor) -> Token:
    """``("tensor", dtype, shape, sha256)``; the bytes of a copy on the CPU."""
    t = t.detach()
    try:
        data = t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError, ValueError):  # sparse, meta, quantized
        return ("tensor", str(t.dtype), tuple(t.shape), t.layout, repr(t))
    return ("tensor", str(t.dtype), tuple(t.shape), _digest(data))


@functools.lru_cache(maxsize=4096)
def library(code_file: str) -> bool:
    """Whether a source file belongs to the standard library or an installed package."""
    if not code_file or code_file.startswith("<"):
        return code_file.startswith("<frozen")
    try:
        resolved = str(Path(code_file).resolve())
    except OSError:
        return False
    return resolved.startswith(_LIBRARY_ROOTS)


@dataclass
class Snapshot:
    """State by path: ``tokens[path]`` and ``kinds[path]`` (e.g. ``"buffer"``)."""

    own: dict[str, Token] = field(default_factory=dict)
    shared: dict[str, Token] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    storages: dict[int, str] = field(default_factory=dict)


class _Walker:
    def __init__(self, snapshot: Snapshot, modules: dict[int, str]) -> None:
        self.out = snapshot
        self.modules = modules
        self.seen: dict[int, str] = {}
        self.functions: set[int] = set()
        self.classes: set[int] = set()
        self.scope = "own"

    def put(self, path: str, kind: str, token: Token) -> None:
        target = self.out.own if self.scope == "own" else self.out.shared
        if path not in target:
            target[path] = token
            self.out.kinds[path] = kind

    def tensor(self, path: str, kind: str, t: Tensor) -> None:
        self.put(path, kind, tensor_token(t))
        if t.numel() and t.device.type != "meta":
            with contextlib.suppress(RuntimeError):
                self.out.storages.setdefault(t.untyped_storage().data_ptr(), path)

    def value(self, v: object, path: str, kind: str, depth: int = 0) -> None:
        """Walk one value (see the module docstring)."""
        if isinstance(v, Tensor):
            self.tensor(path, kind, v)
        elif v is None or isinstance(v, bool | int | str | bytes | complex):
            self.put(path, kind, (type(v).__name__, v))
        elif isinstance(v, float):
            self.put(path, kind, ("float", v.hex()))
        elif isinstance(v, np.ndarray | np.generic):
            array = np.asarray(v)
            data = array.tobytes() if array.dtype.kind != "O" else repr(v).encode()
            self.put(path, kind, ("array", array.dtype.str, array.shape, _digest(data)))
        elif isinstance(v, enum.Enum | types.ModuleType | type | torch.dtype):
            self.put(path, kind, ("named", repr(v)))
        elif id(v) in self.modules:
            self.put(path, kind, ("module", self.modules[id(v)]))
        elif id(v) in self.seen:
            self.put(path, kind, ("ref", self.seen[id(v)]))
        elif depth > MAX_DEPTH:
            self.put(path, kind, ("deep", type(v).__qualname__, id(v)))
        else:
            self.seen[id(v)] = path
            self.composite(v, path, kind, depth + 1)

    def composite(self, v: object, path: str, kind: str, depth: int) -> None:
        if isinstance(v, list | tuple):
            self.put(path, kind, (type(v).__name__, len(v)))
            for i, item in enumerate(v):
                self.value(item, f"{path}[{i}]", kind, depth)
        elif isinstance(v, dict):
            self.put(path, kind, (type(v).__name__, tuple(map(repr, v))))
            for key, item in v.items():
                self.value(item, f"{path}[{key!r}]", kind, depth)
        elif isinstance(v, set | frozenset):
            self.put(path, kind, (type(v).__name__, tuple(sorted(map(repr, v)))))
        elif isinstance(v, torch.Generator):
            self.put(path, kind, ("generator", tensor_token(v.get_state())[3]))
        elif isinstance(v, types.FunctionType):
            self.put(path, kind, ("function", v.__qualname__))
            self.function(v, depth)
        elif isinstance(v, types.MethodType):
            self.put(path, kind, ("method", v.__func__.__qualname__))
            self.value(v.__self__, f"{path}.__self__", kind, depth)
            self.value(v.__func__, f"{path}.__func__", kind, depth)
        elif isinstance(v, functools.partial):
            self.put(path, kind, ("partial",))
            self.value(v.func, f"{path}.func", kind, depth)
            self.value(v.args, f"{path}.args", kind, depth)
            self.value(v.keywords, f"{path}.keywords", kind, depth)
        elif callable(getattr(v, "cache_info", None)):  # functools.lru_cache
            info = getattr(v, "cache_info")()  # noqa: B009 (typed as object)
            self.put(path, kind, ("cache", getattr(info, "currsize", None)))
            wrapped = getattr(v, "__wrapped__", None)
            if isinstance(wrapped, types.FunctionType):
                self.function(wrapped, depth)
        elif self.scope == "shared" and _library_class(type(v)):
            # a library object reached from a global (a logger, a config):
            # its identity is compared, its internals are the library's
            self.put(path, kind, _opaque(v))
        elif hasattr(v, "__dict__") or hasattr(type(v), "__slots__"):
            self.put(path, kind, ("object", type(v).__qualname__))
            self.user_class(type(v))
            for key, item in _fields(v):
                self.value(item, f"{path}.{key}", kind, depth)
        else:  # a C object we cannot look into
            self.put(path, kind, _opaque(v))

    def function(self, f: types.FunctionType, depth: int = 0) -> None:
        """Closure cells, defaults and the globals named by a user function."""
        code = f.__code__
        if id(f) in self.functions or library(code.co_filename):
            return
        self.functions.add(id(f))
        scope, self.scope = self.scope, "shared"
        try:
            where = f"{f.__module__}.{f.__qualname__}"
            for name, cell in zip(code.co_freevars, f.__closure__ or (), strict=False):
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                self.value(content, f"{where}.<closure {name}>", "closure variable")
            defaults = (f.__defaults__, f.__kwdefaults__)
            if any(defaults):
                self.value(defaults, f"{where}.<defaults>", "default argument")
            for name in _names(code):
                if name not in f.__globals__:
                    continue
                item = f.__globals__[name]
                if isinstance(item, types.ModuleType | types.BuiltinFunctionType):
                    continue
                if isinstance(item, type):
                    self.user_class(item)
                elif isinstance(item, types.FunctionType):
                    self.function(item, depth)
                else:
                    self.value(item, f"{f.__module__}.{name}", "global", depth)
        finally:
            self.scope = scope

    def user_class(self, cls: type) -> None:
        """Class attributes and methods of a class defined outside packages."""
        for klass in cls.__mro__:
            if id(klass) in self.classes or klass is object:
                continue
            self.classes.add(id(klass))
            if _library_class(klass):
                continue
            scope, self.scope = self.scope, "shared"
            try:
                where = f"{klass.__module__}.{klass.__qualname__}"
                for name, item in vars(klass).items():
                    if name.startswith("__") and name.endswith("__"):
                        continue
                    functions = _functions_of(item)
                    for f in functions:
                        self.function(f)
                    if not functions and not isinstance(item, property):
                        self.value(item, f"{where}.{name}", "class attribute")
            finally:
                self.scope = scope

    def hooks(self, hooks: dict[int, Callable[..., Any]], path: str) -> None:
        scope, self.scope = self.scope, "shared"
        try:
            for i, hook in enumerate(hooks.values()):
                self.value(hook, f"{path}[{i}]", "hook")
        finally:
            self.scope = scope


def _opaque(v: object) -> Token:
    """An object we cannot look into: its identity, and its repr if it shows state.

    ``itertools.count(5)`` shows its state; ``<generator object ... at 0x...>`` only
    an address (then the identity alone is compared).
    """
    try:
        text = repr(v)
    except Exception:  # a repr that fails shows no state
        text = ""
    shown = _digest(text.encode()) if text and "0x" not in text else None
    return ("opaque", type(v).__qualname__, id(v), shown)


def _library_class(cls: type) -> bool:
    source = getattr(sys.modules.get(cls.__module__), "__file__", "") or ""
    return cls.__module__ == "builtins" or library(source)


def _fields(v: object) -> Iterator[tuple[str, object]]:
    yield from getattr(v, "__dict__", {}).items()
    for klass in type(v).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if name != "__dict__" and hasattr(v, name):
                yield name, getattr(v, name)


def _functions_of(item: object) -> list[types.FunctionType]:
    if isinstance(item, types.FunctionType):
        return [item]
    if isinstance(item, staticmethod | classmethod):
        inner = item.__func__
        return [inner] if isinstance(inner, types.FunctionType) else []
    if isinstance(item, property):
        return [f for f in (item.fget, item.fset) if isinstance(f, types.FunctionType)]
    return []


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def capture(model: nn.Module) -> Snapshot:
    """Snapshot the module's own and shared state (see the module docstring)."""
    snapshot = Snapshot()
    modules = {id(m): name or "<root>" for name, m in model.named_modules()}
    walker = _Walker(snapshot, modules)
    for name, p in model.named_parameters(remove_duplicate=False):
        walker.tensor(name, "parameter", p)
    for name, b in model.named_buffers(remove_duplicate=False):
        walker.tensor(name, "buffer", b)
    for prefix, module in model.named_modules():
        walker.user_class(type(module))
        forward = getattr(type(module), "forward", None)
        if isinstance(forward, types.FunctionType):  # a user patch of a library class
            walker.function(forward)
        for key, value in vars(module).items():
            if key in _MODULE_KEYS and key != "training":
                continue
            path = f"{prefix}.{key}" if prefix else key
            walker.value(value, path, "attribute")
        for key in _HOOK_KEYS:
            hooks = getattr(module, key, None)
            if hooks:
                walker.hooks(hooks, f"{prefix or '<root>'}.{key}")
    for key in _GLOBAL_HOOKS:
        hooks = getattr(module_globals, key, None)
        if hooks:
            walker.hooks(hooks, f"torch.nn.modules.module.{key}")
    walker.scope = "shared"
    snapshot.shared["<torch global generator>"] = tensor_token(torch.get_rng_state())
    name, keys, pos, gauss, cached = np.random.get_state()  # noqa: NPY002
    legacy = (name, _digest(np.ascontiguousarray(keys).tobytes()), pos, gauss, cached)
    snapshot.shared["<numpy global generator>"] = ("np", *legacy)
    version, internal, spare = random.getstate()
    state = _digest(np.asarray(internal, dtype=np.uint64).tobytes())
    snapshot.shared["<python random>"] = ("random", version, state, repr(spare))
    for key in (
        "<torch global generator>",
        "<numpy global generator>",
        "<python random>",
    ):
        snapshot.kinds[key] = "random generator"
    return snapshot


def differences(before: dict[str, Token], after: dict[str, Token]) -> list[str]:
    """Paths whose token differs, appeared or disappeared (in walk order)."""
    changed = [p for p, t in after.items() if before.get(p, _MISSING) != t]
    return changed + [p for p in before if p not in after]


_MISSING: Token = ("<missing>",)
