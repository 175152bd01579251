"""Audit specs: TOML files that name the model's loader and what to test.

A spec (``defense-suite audit SPEC.toml --out DIR``)::

    name = "breast-cancer-mlp"
    loader = "defenses.audit.examples:breast_cancer_mlp"   # module:function
    defenses = ["rounding", "label-only", {name = "ssd-shield", epsilon = 1.0}]
    private_class = 0            # optional; overrides the loader's
    seeds = [0, 1, 2]

    [loader_args]                # keyword arguments of the loader
    seed = 0

    [threat]                     # defenses.audit.threat_model's arguments
    access = "scores"            # or "labels"
    queries = 20000              # per attack; omit for unlimited
    aux_data = true
    adaptive = false

    [shadows]                    # ShadowConfig's fields
    n_shadows = 4

    [attacks.brep]               # BoundaryRepulsion's fields
    iterations = 30
    [attacks.mirror]             # GeneticInversion's fields
    generations = 25

The loader is imported and called: the model comes from code the user controls, never
from unpickling a file. A loader module may sit next to the spec (``my_model.py``
beside ``my-audit.toml``, named ``loader = "my_model:load"``): while the loader is
imported and called, the spec's folder is searched first, so no ``PYTHONPATH`` is
needed; a module of that name elsewhere (installed, or on ``sys.path``) is used
only when the spec's folder holds none. Defense names are the registry's
(``defense-suite list``).
Every error is a :class:`AuditSpecError` (a ``ValueError``) naming the file and key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from defenses import registry
from defenses.audit.config import AuditConfig
from defenses.audit.inputs import AuditInputs
from defenses.audit.shadows import ShadowConfig
from defenses.audit.threats import threat_model
from defenses.ssd.attacks import BoundaryRepulsion, GeneticInversion
from defenses.threat import ThreatModel

TOP_KEYS = {
    "name",
    "loader",
    "loader_args",
    "defenses",
    "private_class",
    "seeds",
    "threat",
    "shadows",
    "attacks",
    "delta",
    "confidence",
    "per_target",
}
THREAT_KEYS = {"access", "queries", "aux_data", "adaptive"}
ATTACK_KEYS = {"brep", "mirror"}


class AuditSpecError(ValueError):
    """An audit spec is malformed (the message names the file and the key)."""


@dataclass(frozen=True, eq=False)
class AuditSpec:
    """A parsed spec: everything :func:`~defenses.audit.audit` needs but the model."""

    path: Path
    name: str
    loader: Callable[..., Any]
    loader_args: Mapping[str, Any]
    defenses: list[Any]
    private_class: Any
    threat: ThreatModel
    config: AuditConfig

    def load(self) -> AuditInputs:
        """Call the loader; its result must be :class:`AuditInputs`."""
        try:
            inspect.signature(self.loader).bind(**self.loader_args)
        except TypeError as error:
            raise AuditSpecError(f"{self.path}: key 'loader_args': {error}") from error
        with beside(self.path):  # the loader may import its neighbours lazily
            inputs = self.loader(**self.loader_args)
        if not isinstance(inputs, AuditInputs):
            raise AuditSpecError(
                f"{self.path}: key 'loader' must name a function returning "
                f"defenses.audit.inputs.AuditInputs, got {type(inputs).__name__}"
            )
        return inputs


def _fail(path: Path, key: str, message: str) -> AuditSpecError:
    return AuditSpecError(f"{path}: key {key!r} {message}")


def _table(path: Path, key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, key, f"must be a table, got {value!r}")
    return value


def _unknown(path: Path, where: str, keys: Any, accepted: set[str]) -> None:
    extra = sorted(set(keys) - accepted)
    if extra:
        prefix = f"{where}." if where else ""
        raise _fail(
            path, f"{prefix}{extra[0]}", f"is not known; accepted: {sorted(accepted)}"
        )


@contextlib.contextmanager
def beside(path: Path) -> Iterator[None]:
    """Search the folder of the spec ``path`` first for imports, while inside."""
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


def _local(path: Path, module_name: str) -> bool:
    """Whether the spec's folder holds the top-level module of ``module_name``."""
    top = path.resolve().parent / module_name.split(".")[0]
    return top.with_suffix(".py").is_file() or (top / "__init__.py").is_file()


def resolve_loader(path: Path, target: Any) -> Callable[..., Any]:
    """Import ``module:function``, from the spec's folder first (see the module).

    Errors name the spec's ``loader`` key.
    """
    if not isinstance(target, str) or target.count(":") != 1:
        raise _fail(path, "loader", f"must be 'module:function', got {target!r}")
    module_name, function = target.split(":")
    try:
        with beside(path):
            if _local(path, module_name):
                module = _import_aside(module_name)
            else:
                module = importlib.import_module(module_name)
    except ImportError as error:
        raise _fail(
            path,
            "loader",
            f"names module {module_name!r}: {error} (searched the spec's folder "
            f"{path.resolve().parent} first, then sys.path)",
        ) from error
    loader = getattr(module, function, None)
    if not callable(loader):
        raise _fail(path, "loader", f"names no function {function!r} in {module_name}")
    found: Callable[..., Any] = loader
    return found


def _import_aside(module_name: str) -> Any:
    """Import a spec's neighbour without touching the process's modules.

    A module of the same top-level name imported before (another spec's neighbour,
    an installed one, or the caller's own) neither shadows this one nor is shadowed
    by it: the names are set aside for the import and restored after it.
    """
    top = module_name.split(".")[0]

    def names() -> list[str]:
        return [m for m in sys.modules if m == top or m.startswith(top + ".")]

    displaced = {name: sys.modules.pop(name) for name in names()}
    try:
        return importlib.import_module(module_name)
    finally:
        for name in names():
            del sys.modules[name]
        sys.modules.update(displaced)


def _dataclass(path: Path, key: str, cls: type, params: Any) -> Any:
    table = _table(path, key, params)
    accepted = {f.name for f in dataclasses.fields(cls) if f.init}
    _unknown(path, key, table, accepted)
    try:
        return cls(**table)
    except (TypeError, ValueError) as error:
        raise _fail(path, key, f"is invalid: {error}") from error


def _defense(path: Path, index: int, entry: Any) -> Any:
    key = f"defenses[{index}]"
    if isinstance(entry, str):
        name, params = entry, {}
    elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
        params = {k: v for k, v in entry.items() if k != "name"}
        name = entry["name"]
    else:
        raise _fail(path, key, f"must be a name or a table with 'name', got {entry!r}")
    try:
        return registry.create("defenses", name, params)
    except KeyError as error:
        raise _fail(path, key, f"names no defense: {error.args[0]}") from error
    except (TypeError, ValueError) as error:
        raise _fail(path, key, f"is invalid: {error}") from error


def _threat(path: Path, value: Any) -> ThreatModel:
    table = _table(path, "threat", value)
    _unknown(path, "threat", table, THREAT_KEYS)
    try:
        return threat_model(**table)
    except (TypeError, ValueError) as error:
        raise _fail(path, "threat", f"is invalid: {error}") from error


def _config(path: Path, spec: dict[str, Any]) -> AuditConfig:
    fields: dict[str, Any] = {}
    if "seeds" in spec:
        seeds = spec["seeds"]
        if not isinstance(seeds, list) or not seeds:
            raise _fail(
                path, "seeds", f"must be a non-empty list of ints, got {seeds!r}"
            )
        fields["seeds"] = tuple(seeds)
    for key in ("delta", "confidence", "per_target"):
        if key in spec:
            fields[key] = spec[key]
    if "shadows" in spec:
        fields["shadows"] = _dataclass(path, "shadows", ShadowConfig, spec["shadows"])
    attacks = _table(path, "attacks", spec.get("attacks", {}))
    _unknown(path, "attacks", attacks, ATTACK_KEYS)
    if "brep" in attacks:
        fields["brep"] = _dataclass(
            path, "attacks.brep", BoundaryRepulsion, attacks["brep"]
        )
    if "mirror" in attacks:
        fields["mirror"] = _dataclass(
            path, "attacks.mirror", GeneticInversion, attacks["mirror"]
        )
    try:
        return AuditConfig(**fields)
    except (TypeError, ValueError) as error:
        raise AuditSpecError(f"{path}: {error}") from error


def load_spec(path: str | Path) -> AuditSpec:
    """Read and check an audit spec (the loader is resolved, not yet called)."""
    file = Path(path)
    try:
        spec = tomllib.loads(file.read_text(encoding="utf-8"))
    except OSError as error:
        raise AuditSpecError(f"{file}: cannot read the spec: {error}") from error
    except tomllib.TOMLDecodeError as error:
        raise AuditSpecError(f"{file}: not valid TOML: {error}") from error
    _unknown(file, "", spec, TOP_KEYS)
    if "loader" not in spec:
        raise _fail(file, "loader", "is missing (give 'module:function')")
    name = spec.get("name", file.stem)
    if not isinstance(name, str) or not name:
        raise _fail(file, "name", f"must be a non-empty string, got {name!r}")
    entries = spec.get("defenses", [])
    if not isinstance(entries, list):
        raise _fail(file, "defenses", f"must be a list, got {entries!r}")
    return AuditSpec(
        path=file,
        name=name,
        loader=resolve_loader(file, spec["loader"]),
        loader_args=_table(file, "loader_args", spec.get("loader_args", {})),
        defenses=[_defense(file, i, e) for i, e in enumerate(entries)],
        private_class=spec.get("private_class"),
        threat=_threat(file, spec.get("threat", {})),
        config=_config(file, spec),
    )
