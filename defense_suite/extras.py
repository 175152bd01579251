"""Optional extras: which component needs which, and the ``pip install`` line to run.

``pip install 'defense-suite[all]'`` installs every extra; a smaller install leaves
some components without the library they need. Rather than fail mid-run with
``No module named 'art'`` after some games have been played, the command line checks
a spec's components before the first game (:func:`require_for`) and ``list`` marks
the components it cannot run (:func:`missing_for`). The check only looks for the
libraries (:func:`importlib.util.find_spec`); it imports nothing.

A component's extras come from :data:`NEEDS`, matched by name prefix; a test checks
that every registered component whose module imports an optional library is
covered.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

DISTRIBUTION = "defense-suite"

EXTRAS: dict[str, tuple[str, ...]] = {
    "federated": ("flwr", "opacus"),
    "crypto": ("tenseal", "transformers"),
    "art": ("art",),
    "pandas": ("pandas",),
    "mapie": ("mapie",),
    "rules": ("hypothesis",),
    "serve": ("mlflow",),
}
"""Each extra of ``pyproject.toml`` and the import names it provides."""

NEEDS: tuple[tuple[str, str], ...] = (
    ("ssd-art-", "art"),
    ("ssd-perf", "art"),
    ("federated-", "federated"),
    ("composition-ssd-federated", "federated"),
    ("crypto-", "crypto"),
    ("serve-", "serve"),
)
"""(component-name prefix, extra): a registered name starting with the prefix needs
the extra, whatever its kind (scenario, attack, defense, benchmark)."""


class MissingExtra(ValueError):
    """A component needs an optional library that is not installed."""


def install_line(extras: Iterable[str]) -> str:
    """The command that installs ``extras``: ``pip install 'defense-suite[a,b]'``."""
    names = ",".join(sorted(set(extras)))
    return f"pip install '{DISTRIBUTION}[{names}]'"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as absent
        return False


def missing_modules(extra: str) -> list[str]:
    """The import names of ``extra`` that are not installed."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; extras are {sorted(EXTRAS)}")
    return [m for m in EXTRAS[extra] if not _installed(m)]


def extras_of(name: str) -> list[str]:
    """The extras the registered component ``name`` needs (by :data:`NEEDS`)."""
    return sorted({extra for prefix, extra in NEEDS if name.startswith(prefix)})


def missing_for(name: str) -> list[str]:
    """The extras of component ``name`` that are not (fully) installed."""
    return [extra for extra in extras_of(name) if missing_modules(extra)]


def require_for(names: Iterable[str], where: str) -> None:
    """Refuse to go on when a component of ``names`` lacks its extra.

    Raises
    ------
    MissingExtra
        Naming ``where`` (the spec), each component, the libraries it lacks and the
        one ``pip install`` line that installs every missing extra.
    """
    lacking: dict[str, list[str]] = {}
    for name in dict.fromkeys(names):
        for extra in missing_for(name):
            lacking.setdefault(extra, []).append(name)
    if not lacking:
        return
    parts = [
        f"{', '.join(components)} need(s) {', '.join(missing_modules(extra))} "
        f"(extra '{extra}')"
        for extra, components in sorted(lacking.items())
    ]
    raise MissingExtra(
        f"{where}: {'; '.join(parts)}, which is not installed; run: "
        f"{install_line(lacking)}"
    )


def explain_import_error(error: BaseException) -> str | None:
    """What to install for ``error``, when an optional library is behind it.

    Follows the chain of causes to a :class:`ModuleNotFoundError` of a module that
    an extra provides; None when there is none (a real bug, shown as it is).
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ModuleNotFoundError) and current.name:
            root = current.name.split(".")[0]
            for extra, modules in EXTRAS.items():
                if root in modules:
                    return (
                        f"{root} is not installed (extra '{extra}'); run: "
                        f"{install_line([extra])}"
                    )
        current = current.__cause__ or current.__context__
    return None
