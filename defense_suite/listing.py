"""``defense-suite list``: the shipped specs at once, the registered components on ask.

The specs are TOML files (:func:`~defense_suite.locations.spec_dir`); listing them
reads each file with :mod:`tomllib` and imports nothing else, so ``list`` answers
in a fraction of a second. The registered components (scenarios, attacks,
defenses, benchmarks, figures) are known only by importing every package's
``scenario`` module (torch, scikit-learn, numba...: seconds), so ``list
--components`` shows them. Both mark what needs an extra that is not installed
(:mod:`defense_suite.extras`, which looks for libraries without importing them),
and ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from defense_suite.extras import extras_of, install_line, missing_for

PROFILES = ("quick", "full")
"""Spec-name suffixes of the two profiles (``ssd-quick``, ``ssd-full``)."""


@dataclass(frozen=True)
class SpecEntry:
    """One shipped spec as ``list`` shows it."""

    name: str
    title: str
    profile: str
    components: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    problem: str = ""


def _components(data: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for key in ("scenario", "benchmark"):
        if isinstance(data.get(key), str):
            names.append(data[key])
    for key in ("attacks", "defenses"):
        value = data.get(key, [])
        if isinstance(value, list):
            names += [v for v in value if isinstance(v, str)]
    return names


def spec_entry(path: Path) -> SpecEntry:
    """The name, title, profile and missing extras of the spec file ``path``.

    A file that is not valid TOML is listed with its problem, not skipped: ``list``
    never fails because of one spec (``run`` names the problem in full).
    """
    name = path.stem
    profile = next((p for p in PROFILES if name.endswith(f"-{p}")), "other")
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as error:
        return SpecEntry(name, "", profile, problem=f"unreadable: {error}")
    title = data.get("title", name)
    components = _components(data)
    missing = sorted({e for c in components for e in missing_for(c)})
    title = title if isinstance(title, str) else name
    return SpecEntry(name, title, profile, components, missing)


def spec_entries(folder: Path) -> list[SpecEntry]:
    """Every ``*.toml`` spec of ``folder``, sorted by name."""
    return [spec_entry(path) for path in sorted(folder.glob("*.toml"))]


def _note(missing: list[str]) -> str:
    return f"  (not installed: {install_line(missing)})" if missing else ""


def specs_text(entries: list[SpecEntry], folder: Path) -> str:
    """The specs as text: one line per spec, ``name  title``, by profile."""
    if not entries:
        return f"no spec files (*.toml) in {folder}"
    width = max(len(e.name) for e in entries)
    lines: list[str] = []
    for profile in (*PROFILES, "other"):
        chosen = [e for e in entries if e.profile == profile]
        if not chosen:
            continue
        lines.append(f"specs, {profile} profile:" if profile != "other" else "specs:")
        for e in chosen:
            text = e.problem or e.title
            lines.append(f"  {e.name:<{width}}  {text}{_note(e.missing)}")
    lines += [
        "",
        "run one: defense-suite run NAME --out FILE.jsonl; "
        "components: defense-suite list --components",
    ]
    return "\n".join(lines)


def components() -> dict[str, Any]:
    """The registered components by kind, each with the extras it lacks.

    Imports every package's ``scenario`` module (seconds). ``not_loaded`` maps a
    built-in module left out for a missing library to the line that installs it.
    """
    from defense_suite.extras import EXTRAS
    from defenses.registry import KINDS, available, skipped

    listing = {kind: available(kind) for kind in KINDS}  # fails before printing
    not_loaded = {}
    for module, library in skipped().items():
        extras = [name for name, libs in EXTRAS.items() if library in libs]
        fix = install_line(extras) if extras else f"pip install {library}"
        not_loaded[module] = {"library": library, "install": fix}
    return {
        "not_loaded": not_loaded,
        **{
            kind: [
                {"name": n, "extras": extras_of(n), "missing": missing_for(n)}
                for n in names
            ]
            for kind, names in listing.items()
        },
    }


def components_text(found: dict[str, Any]) -> str:
    """The components as the indented text ``list --components`` prints."""
    lines = [
        f"not loaded: {module} (no module {info['library']!r}: {info['install']})"
        for module, info in found["not_loaded"].items()
    ]
    for kind, items in found.items():
        if kind == "not_loaded":
            continue
        lines.append(f"{kind}:")
        lines += [f"  {item['name']}{_note(item['missing'])}" for item in items]
    return "\n".join(lines)


def listing(folder: Path, with_components: bool, as_json: bool) -> str:
    """What ``defense-suite list [--components] [--json]`` prints."""
    entries = spec_entries(folder)
    if as_json:
        out: dict[str, Any] = {
            "spec_dir": str(folder),
            "specs": [asdict(e) for e in entries],
        }
        if with_components:
            out["components"] = components()
        return json.dumps(out, indent=2)
    if with_components:
        return components_text(components())
    return specs_text(entries, folder)
