"""The poisoning game's task: train / calibration / test splits and the targets."""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from defenses.arrays import IntArray
from defenses.data import Dataset
from defenses.rps.partition import part_of


@dataclass(frozen=True)
class ConformalTask:
    """Data of one game; a poisoned task keeps the clean one in ``clean``.

    Attributes
    ----------
    train, calib, test : Dataset
        Training, calibration and test splits.
    targets : ndarray of int
        Indices into ``test`` of the points a targeted attacker aims at.
    clean : ConformalTask or None
        The task before poisoning (None for a clean task).
    """

    train: Dataset
    calib: Dataset
    test: Dataset
    targets: IntArray
    clean: ConformalTask | None = None

    def poisoned(
        self, train: Dataset | None = None, calib: Dataset | None = None
    ) -> ConformalTask:
        """A new task with replaced splits, remembering the clean task."""
        base = self.clean if self.clean is not None else self
        return replace(
            self,
            train=train if train is not None else self.train,
            calib=calib if calib is not None else self.calib,
            clean=base,
        )


def _row_keys(data: Dataset) -> list[bytes]:
    X = np.ascontiguousarray(data.X, dtype=np.float64)
    return [
        X[i].tobytes() + int(data.y[i]).to_bytes(8, "little") for i in range(len(data))
    ]


def changed_rows(clean: Dataset, poisoned: Dataset) -> tuple[int, list[bytes]]:
    """Size of the multiset difference of (x, y) rows, and the changed rows' x bytes.

    A label flip is one deletion plus one insertion of the same x (same part): it
    counts as one change; an insertion or a deletion counts as one.
    """
    before, after = Counter(_row_keys(clean)), Counter(_row_keys(poisoned))
    removed, added = before - after, after - before
    xs = [key[:-8] for key in (removed + added).elements()]
    flips = Counter(key[:-8] for key in removed.elements()) & Counter(
        key[:-8] for key in added.elements()
    )
    return len(xs) - sum(flips.values()), xs


def touched_parts(clean: Dataset, poisoned: Dataset, n_parts: int) -> int:
    """Number of hash parts holding a changed row (the certificate's radius)."""
    _, xs = changed_rows(clean, poisoned)
    if not xs:
        return 0
    X = np.stack([np.frombuffer(x, dtype=np.float64) for x in xs])
    return int(np.unique(part_of(X, n_parts)).size)


def checksum(data: Dataset) -> int:
    """CRC-32 of a split (to tell splits apart cheaply)."""
    return zlib.crc32(np.ascontiguousarray(data.X).tobytes() + data.y.tobytes())
