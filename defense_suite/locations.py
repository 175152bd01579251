"""Where the command line finds the shipped specs and the checkout's README.

In a checkout (this package's parent folder holds ``pyproject.toml`` and
``benchmarks/specs``) the specs are read from ``benchmarks/specs``, so an edited spec
takes effect at once; an installed wheel carries a copy of them as
``defense_suite/specs`` (the build's ``force-include``).
"""

from __future__ import annotations

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


def default_readme() -> Path:
    """The README whose results block ``report --readme`` refreshes.

    The checkout's ``README.md``; outside a checkout, ``README.md`` in the current
    folder.
    """
    root = checkout_root()
    return root / "README.md" if root is not None else Path("README.md")
