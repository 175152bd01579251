"""Registry of scenarios, attacks, defenses and measurement benchmarks.

Components register themselves with :func:`register`. The registry finds the built-in
packages by importing each package's ``scenario`` module (``defenses.<pkg>.scenario``,
``defense_suite.federated.scenario``, ``defense_suite.crypto.scenario``), which
registers, or imports the modules that register, everything the package offers;
third-party packages add a module to the ``defense_suite.plugins`` entry-point group.

A *benchmark* is a measurement that is not an attack-versus-defense game (a timing
side by side, a coverage study): a callable ``(params, seeds) -> Iterable[Result]``.
A *figure* is a package's own plot for the report, registered under the package name
(the spec name up to its first '-' or '_'): a callable
``(results, out_dir) -> list[(caption, png_path)]``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar

Kind = Literal["scenarios", "attacks", "defenses", "benchmarks", "figures"]
KINDS: tuple[Kind, ...] = ("scenarios", "attacks", "defenses", "benchmarks", "figures")
BUILTIN_ROOTS = ("defenses", "defense_suite.federated", "defense_suite.crypto")
PLUGIN_GROUP = "defense_suite.plugins"

_registry: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
_discovered = False
_skipped: dict[str, str] = {}
"""Built-in ``scenario`` modules left out because an optional library is missing
(module -> the top-level name of the library it could not import)."""

C = TypeVar("C")


def register(kind: Kind, name: str) -> Callable[[C], C]:
    """Class (or function) decorator: make the object known under ``name``."""
    if kind not in KINDS:
        raise ValueError(f"unknown registry kind {kind!r}; kinds are {KINDS}")

    def decorate(obj: C) -> C:
        known = _registry[kind].get(name)
        if known is not None and known is not obj:
            raise ValueError(f"{kind[:-1]} name {name!r} is already taken by {known!r}")
        _registry[kind][name] = obj
        return obj

    return decorate


def register_package(
    *,
    attacks: Iterable[Any] = (),
    defenses: Iterable[Any] = (),
    benchmarks: Mapping[str, Callable[..., Any]] | None = None,
    figures: Mapping[str, Callable[..., Any]] | None = None,
) -> None:
    """Register a package's components in one call (its ``scenario`` module's job).

    Attacks and defenses are registered under their ``name`` attribute; benchmarks
    and figures under the keys of their mappings.
    """
    for kind, named in (("attacks", attacks), ("defenses", defenses)):
        for component in named:
            register(kind, component.name)(component)  # type: ignore[arg-type]
    for kind, table in (("benchmarks", benchmarks), ("figures", figures)):
        for name, function in (table or {}).items():
            register(kind, name)(function)  # type: ignore[arg-type]


def _builtin_modules() -> list[str]:
    modules = []
    for root in BUILTIN_ROOTS:
        try:
            spec = importlib.util.find_spec(root)
        except ModuleNotFoundError:  # its parent package is not installed
            spec = None
        if spec is None:
            continue
        if importlib.util.find_spec(f"{root}.scenario") is not None:
            modules.append(f"{root}.scenario")
        for info in pkgutil.iter_modules(spec.submodule_search_locations or []):
            name = f"{root}.{info.name}.scenario"
            try:  # finding a subpackage's module imports the subpackage itself
                found = info.ispkg and importlib.util.find_spec(name) is not None
            except ModuleNotFoundError as error:
                _skip(f"{root}.{info.name}", error)
                continue
            if found:
                modules.append(name)
    return modules


def _skip(module: str, error: ModuleNotFoundError) -> None:
    """Leave out a built-in module whose optional library is missing; else raise."""
    library = (error.name or "").partition(".")[0]
    if library in ("", "defenses", "defense_suite"):
        raise ImportError(
            f"defense-suite could not load {module!r}: {error}"
        ) from error
    _skipped[module] = library


def discover() -> None:
    """Import every built-in package's ``scenario`` module and every plugin, once."""
    global _discovered
    if _discovered:
        return
    from importlib.metadata import entry_points

    builtin = _builtin_modules()
    modules = [*builtin, *(e.value for e in entry_points(group=PLUGIN_GROUP))]
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if module not in builtin:
                raise ImportError(
                    f"defense-suite could not load the plugin module {module!r}: "
                    f"{error}"
                ) from error
            _skip(module, error)
        except Exception as error:
            raise ImportError(
                f"defense-suite could not load the plugin module {module!r}: {error}"
            ) from error
    _discovered = True


def skipped() -> dict[str, str]:
    """Built-in packages not loaded, each with the optional library it lacks.

    A smaller install than ``[all]`` leaves, say, ``defense_suite.federated``
    without ``flwr``: discovery loads every other package and lists this one here
    instead of failing as a whole.
    """
    discover()
    return dict(_skipped)


def available(kind: Kind) -> list[str]:
    """Sorted names registered under ``kind``."""
    discover()
    return sorted(_registry[kind])


def load(kind: Kind, name: str) -> Any:
    """Return the object registered as ``name``."""
    if kind not in KINDS:
        raise ValueError(f"unknown registry kind {kind!r}; kinds are {KINDS}")
    discover()
    if name not in _registry[kind]:
        raise KeyError(
            f"no {kind[:-1]} named {name!r}; known: {sorted(_registry[kind])}"
        )
    return _registry[kind][name]


def create(kind: Kind, name: str, params: Mapping[str, Any] | None = None) -> Any:
    """Instantiate the registered class ``name`` with ``params``.

    An unknown parameter is an error that names it and lists the accepted ones.
    """
    cls = load(kind, name)
    params = dict(params or {})
    if dataclasses.is_dataclass(cls):
        accepted = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(params) - accepted)
        if unknown:
            raise ValueError(
                f"{kind[:-1]} {name!r} has no parameter(s) {unknown}; "
                f"accepted: {sorted(accepted)}"
            )
    return cls(**params)
