"""The seal of a saved shielded model: file digests and the state's recorded layout.

At save, :func:`digests` computes the SHA-256 of every file under the model's
``data/shield`` folder (the state, the config, the wrapped model's own MLflow
folder), which :func:`defenses.serving.save_shielded` records in the flavour's
entry of the ``MLmodel`` file, and :func:`state_layout` the shape and dtype of
every state array, recorded in ``config.json``. At load, :func:`verify_digests`
runs before anything is parsed or unpickled, and :func:`check_state_layout` once
the arrays are read: a file changed, added or removed after saving, or a state
array of another name, shape or dtype, is refused with a :class:`StateError`
naming the file or the array.

What the digests catch: an edit made without rewriting ``MLmodel`` (a threshold
array of another shape, swapped prototype rows, another epsilon, a replaced
pickle, a disk or copy error). What they do not: an adversary who can write every
file can rewrite the digests too; they are a check, not a signature.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

ALGORITHM = "sha256"
CHUNK = 1 << 20


class StateError(ValueError):
    """A saved model's files or state do not match what was recorded at save."""


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB chunks (hex)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())


def digests(folder: Path, prefix: str) -> dict[str, str]:
    """``{prefix/relative path: sha256}`` of every file under ``folder``."""
    return {
        f"{prefix}/{path.relative_to(folder).as_posix()}": file_digest(path)
        for path in _files(folder)
    }


def verify_digests(folder: Path, prefix: str, recorded: Any) -> None:
    """Refuse unless the files under ``folder`` are exactly those ``recorded``.

    ``recorded`` maps ``prefix/relative path`` to the SHA-256 recorded at save.

    Raises
    ------
    StateError
        Naming the first file that changed, appeared or is missing, or saying that
        no digests were recorded (a model saved without them is not loaded).
    """
    if not isinstance(recorded, Mapping) or not recorded:
        raise StateError(
            f"{prefix}: the model records no file digests (saved by an older "
            "version, or its MLmodel file was edited); save it again to load it"
        )
    present = {
        f"{prefix}/{path.relative_to(folder).as_posix()}": path
        for path in _files(folder)
    }
    for name in sorted(set(recorded) | set(present)):
        if name not in present:
            raise StateError(f"{name}: recorded at save, missing now")
        if name not in recorded:
            raise StateError(f"{name}: not among the files recorded at save")
        if present[name].is_symlink():
            raise StateError(f"{name}: is a symbolic link; saved files never are")
        found = file_digest(present[name])
        if found != recorded[name]:
            raise StateError(
                f"{name}: its {ALGORITHM} digest {found[:16]}... differs from the "
                f"one recorded at save ({str(recorded[name])[:16]}...): the file was "
                "changed after saving; refusing to load it"
            )


def state_layout(state: Mapping[str, npt.NDArray[Any]]) -> dict[str, Any]:
    """``{array name: {"shape": [...], "dtype": "..."}}`` of the state arrays."""
    return {
        name: {"shape": list(np.shape(value)), "dtype": np.asarray(value).dtype.str}
        for name, value in state.items()
    }


def check_state_layout(
    state: Mapping[str, npt.NDArray[Any]], recorded: Any, where: str
) -> None:
    """Refuse state arrays that differ from ``recorded`` in name, shape or dtype.

    Raises
    ------
    StateError
        Naming ``where``, the array and what was recorded.
    """
    if not isinstance(recorded, Mapping):
        raise StateError(f"{where}: no record of the state's arrays")
    missing = sorted(set(recorded) - set(state))
    extra = sorted(set(state) - set(recorded))
    if missing or extra:
        raise StateError(f"{where}: state arrays missing {missing}, unexpected {extra}")
    for name, value in state.items():
        want = recorded[name]
        if not isinstance(want, Mapping):
            raise StateError(f"{where}: no record of state array {name!r}")
        shape, dtype = list(np.shape(value)), np.asarray(value).dtype.str
        if shape != list(want.get("shape", ())):
            raise StateError(
                f"{where}: state array {name!r} has shape {tuple(shape)}; "
                f"saved with {tuple(want.get('shape', ()))}"
            )
        if dtype != want.get("dtype"):
            raise StateError(
                f"{where}: state array {name!r} has dtype {dtype}; saved with "
                f"{want.get('dtype')}"
            )


def reseal(root: str | Path, prefix: str = "data/shield") -> None:
    """Record the digests of the files as they are now in ``root``'s ``MLmodel``.

    For an owner who changed a saved model's files on purpose (and for tests that
    play an adversary able to rewrite every file): the next load accepts the files
    as they are. The shape and consistency checks still run.
    """
    from mlflow.models import Model

    root = Path(root)
    model = Model.load(str(root / "MLmodel"))
    for name, entry in model.flavors.items():
        if name != "python_function" and entry.get("data") == prefix:
            entry["digests"] = digests(root / prefix, prefix)
    model.save(str(root / "MLmodel"))
