"""Dataclass field plumbing shared by the packages' configurations.

A scenario often carries the fields of a smaller configuration (a training config,
a model spec) and hands them on; :func:`values_of` reads them by name, so a field
added to the smaller configuration travels without another line of wiring.
:func:`owner_key` names a field in an error message as the harness's components do
(``Owner.field``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

Key = Callable[[str], str]
"""From a field's name to its name in an error message."""


def values_of(fields_class: type, source: object) -> dict[str, Any]:
    """``{name: source.name}`` over the init fields of dataclass ``fields_class``."""
    return {
        f.name: getattr(source, f.name)
        for f in dataclasses.fields(fields_class)
        if f.init
    }


def owner_key(owner: object) -> Key:
    """Name a field ``Owner.field``, ``Owner`` being ``owner``'s class name."""
    name = type(owner).__name__
    return lambda field: f"{name}.{field}"
