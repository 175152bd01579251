"""Where the command line finds the shipped specs and the checkout's README.

In a checkout (this package's parent folder holds ``pyproject.toml`` and
``benchmarks/specs``) the specs are read from ``benchmarks/specs`` and the example
audit specs from ``benchmarks/audits``, so an edited spec takes effect at once; an
installed wheel carries a copy of them as ``defense_suite/specs`` and
``defense_suite/audits`` (the build's ``force-include``).

A spec is named on the command line by a path or, when no such file exists, by the
name of a shipped spec (``defense-suite run ssd-quick``): :func:`resolve_spec`.
"""

from __future__ import annotations

import difflib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
_ROOT = PACKAGE.parent


def checkout_root() -> Path | None:
    """The root of the source checkout this package runs from, or None if installed."""
    if (_ROOT / "pyproject.toml").is_file() and (
        _ROOT / "benchmarks" / "specs"
    ).is_dir():
        return _ROOT
    return None


def spec_dir() -> Path:
    """The folder of the shipped benchmark specs (``*-quick.toml``, ``*-full.toml``)."""
    root = checkout_root()
    return root / "benchmarks" / "specs" if root is not None else PACKAGE / "specs"


def audit_dir() -> Path:
    """The folder of the shipped example audit specs (``defense-suite audit``)."""
    root = checkout_root()
    return root / "benchmarks" / "audits" if root is not None else PACKAGE / "audits"


def resolve_spec(text: str, shipped: Path, what: str = "spec") -> Path:
    """The spec file ``text`` names: a path, else a shipped spec of that name.

    ``text`` is a path when a file exists there; otherwise, when it is a bare name
    (no folder; ``.toml`` optional), the file of that name in ``shipped``.

    Raises
    ------
    ValueError
        Naming ``text`` when it is a folder, or neither a file nor a shipped spec
        (with the closest shipped names).
    """
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"{what} {text}: is a directory, not a spec file")
    if path.is_file():
        return path
    if path.parent == Path(".") and text not in ("", ".", ".."):
        stem = text.removesuffix(".toml")
        candidate = shipped / f"{stem}.toml"
        if candidate.is_file():
            return candidate
        names = sorted(p.stem for p in shipped.glob("*.toml"))
        raise ValueError(
            f"{what} {text}: no such file, and no shipped {what} of that name"
            f"{suggest(stem, names, what)}"
        )
    raise ValueError(f"{what} {text}: no such file")


def nearest(name: str, names: list[str], n: int = 5) -> list[str]:
    """The names closest to ``name``: those it starts or is part of, then difflib's.

    ``ssd`` gives the ``ssd-*`` and ``ssd_*`` specs; ``ssd-quik`` gives
    ``ssd-quick`` (:func:`difflib.get_close_matches`, ratio >= 0.5); a name close to
    none of them gives the three nearest all the same.
    """
    contains = [other for other in names if name and name in other]
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.5)
    found = list(dict.fromkeys([*close, *contains]))[:n]
    return found or difflib.get_close_matches(name, names, n=3, cutoff=0.0)


def suggest(name: str, names: list[str], what: str = "spec") -> str:
    """``; did you mean a, b?`` with the nearest names, and where to see them all.

    Never a folder path: the shipped specs live inside the installed package, a
    path the user neither chose nor needs.
    """
    close = nearest(name, names)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    if what != "spec":  # a handful of example audits: name them all
        return f"{hint} (shipped: {', '.join(names) or 'none'})"
    return f"{hint} (defense-suite list shows them all)"


def default_readme() -> Path:
    """The README whose results block ``report --readme`` refreshes.

    The checkout's ``README.md``; outside a checkout, ``README.md`` in the current
    folder.
    """
    root = checkout_root()
    return root / "README.md" if root is not None else Path("README.md")
