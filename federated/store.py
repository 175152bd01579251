r"""A client's lifetime privacy ledger on its own disk: durable, checked, locked.

The budget :math:`(\varepsilon_n, \delta)` of a client covers *every* release made
from its records, over all runs and restarts, so the ledger cannot live in a run's
memory. :class:`LedgerFile` keeps it in one JSON file in the node's own storage:

* every grant :math:`(\text{run}, t, q, \sigma, k)` ever made, and the agreement it
  was made under (:math:`\varepsilon_n`, :math:`\delta`, the accountant);
* a SHA-256 digest of that content, so a truncated, corrupted or hand-edited file
  is detected (an adversary with write access to the node's disk is outside the
  threat model: it could as well read the records);
* written crash-safely: a temporary file in the same folder, ``fsync``, atomic
  ``os.replace``, ``fsync`` of the folder. A grant is on disk before the caller
  trains, so no update can leave the client uncharged;
* the fingerprints of every record a grant was charged for (:func:`fingerprints`:
  SHA-256 of each row's float64 bytes, 128 bits), so a public evaluate split that
  shares a record with any run's training data is refused
  (:meth:`LedgerFile.charged_records`);
* checked and charged under an exclusive ``fcntl.flock`` on ``<path>.lock``, so two
  messages handled at the same time (two simulation actors, two processes) are
  serialised: the second sees the first's charge.

A missing file is created only when the caller allows it (the node operator's
``ledger-init``, or the simulation); an unreadable, corrupt or tampered file, or one
opened under another agreement, raises :class:`LedgerUnavailable` and the client
trains no more until its operator acts (fail closed). No server message can reset
it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .ledger import ClientPrivacy, Grant, PrivacyLedger, RoundRefused

logger = logging.getLogger(__name__)

FORMAT = "defense-suite-ledger/1"


class LedgerUnavailable(RoundRefused):
    """The ledger is missing, unreadable, corrupt, tampered or for another budget."""

    category = "ledger-unavailable"


def _digest(body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprints(rows: npt.ArrayLike, pad_to: int = 0) -> list[str]:
    """One fingerprint per record: SHA-256 (first 128 bits) of its float64 bytes.

    ``rows`` has one record per leading index (features flattened); the same record
    loaded the same way gives the same fingerprint in every run. ``pad_to`` (a
    public count) hashes zero rows of the same width up to that many rows and
    discards their digests, so that the time is that of ``max(n, pad_to)`` rows,
    not of the private ``n``.
    """
    arr = np.ascontiguousarray(np.asarray(rows, dtype=np.float64))
    flat = arr.reshape(arr.shape[0], -1) if arr.ndim else arr.reshape(1, 1)
    out = [hashlib.sha256(row.tobytes()).hexdigest()[:32] for row in flat]
    padding = np.zeros((max(0, int(pad_to) - len(flat)), flat.shape[1]))
    for row in padding:
        hashlib.sha256(row.tobytes()).hexdigest()
    return out


def _agreement(privacy: ClientPrivacy) -> dict[str, Any]:
    return {
        "epsilon": float(privacy.epsilon),
        "delta": float(privacy.delta),
        "accountant": str(privacy.accountant),
    }


@dataclass(frozen=True)
class Entry:
    """One granted round of one run."""

    run: int
    grant: Grant

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        g = self.grant
        return {
            "run": self.run,
            "round": g.server_round,
            "rate": g.rate,
            "sigma": g.sigma,
            "steps": g.steps,
        }


def _entry(row: object) -> Entry:
    if not isinstance(row, dict):
        raise ValueError(f"a ledger entry must be an object, got {row!r}")
    run, rnd, rate = row["run"], row["round"], row["rate"]
    sigma, steps = row["sigma"], row["steps"]
    ints = (run, rnd, steps)
    reals = (rate, sigma)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        raise ValueError(f"ledger entry {row!r}: run, round, steps must be integers")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in reals):
        raise ValueError(f"ledger entry {row!r}: rate and sigma must be numbers")
    if not (0 < rate <= 1 and sigma > 0 and steps >= 1 and math.isfinite(sigma)):
        raise ValueError(f"ledger entry {row!r} is out of range")
    return Entry(int(run), Grant(int(rnd), float(rate), float(sigma), int(steps)))


class LedgerFile:
    """The durable lifetime ledger of one node, at ``path``.

    Parameters
    ----------
    path : str or Path
        The ledger file (its folder is created if needed; ``<path>.lock`` beside it).
    create : bool
        Create the file when it is missing (else a missing file refuses).
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool) -> None:
        self.path = Path(path)
        self.create = create
        self._records: set[str] = set()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise LedgerUnavailable(
                f"the privacy ledger {self.path} cannot be locked: {error}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _read(self, privacy: ClientPrivacy) -> list[Entry]:
        """The entries on disk (an empty list for a file allowed to be created)."""
        if not self.path.exists():
            if not self.create:
                raise LedgerUnavailable(
                    f"the privacy ledger {self.path} is missing; the client trains "
                    "only with its lifetime ledger (a new node: set ledger-init=true "
                    "in its node config once)"
                )
            self._records = set()
            return []
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            body = {k: v for k, v in data.items() if k != "sha256"}
            if data.get("format") != FORMAT or data.get("sha256") != _digest(body):
                raise ValueError("its digest does not match its content")
            entries = [_entry(row) for row in body["grants"]]
            agreed = body["agreement"]
            charged = body.get("records", [])
            if not all(isinstance(r, str) for r in charged):
                raise ValueError("record fingerprints must be strings")
            self._records = set(charged)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise LedgerUnavailable(
                f"the privacy ledger {self.path} is unreadable, corrupt or tampered "
                f"({error}); the client refuses to train until its operator acts"
            ) from None
        if agreed != _agreement(privacy):
            raise LedgerUnavailable(
                f"the privacy ledger {self.path} was opened under {agreed}, not "
                f"{_agreement(privacy)}; a lifetime budget is changed by the node's "
                "operator only"
            )
        return entries

    def _write(self, privacy: ClientPrivacy, entries: list[Entry]) -> None:
        body: dict[str, Any] = {
            "format": FORMAT,
            "agreement": _agreement(privacy),
            "grants": [e.to_dict() for e in entries],
        }
        if self._records:
            body["records"] = sorted(self._records)
        text = json.dumps({**body, "sha256": _digest(body)}, indent=1)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)

    def ledger(self, privacy: ClientPrivacy, run: int) -> PrivacyLedger:
        """The ledger as the client sees it in ``run`` (read under the lock)."""
        with self._locked():
            return self._split(privacy, run, self._read(privacy))

    @staticmethod
    def _split(privacy: ClientPrivacy, run: int, entries: list[Entry]) -> PrivacyLedger:
        return PrivacyLedger(
            privacy,
            answered=[e.grant for e in entries if e.run == run],
            earlier=[e.grant for e in entries if e.run != run],
        )

    def charged_records(self, privacy: ClientPrivacy) -> set[str]:
        """Fingerprints of every record any grant was charged for (all runs)."""
        with self._locked():
            self._read(privacy)
            return set(self._records)

    def charge(
        self,
        privacy: ClientPrivacy,
        run: int,
        decide: Callable[[PrivacyLedger], Grant],
        records: Sequence[str] = (),
    ) -> tuple[Grant, PrivacyLedger]:
        """Atomically: read, ``decide`` (raise to refuse), append, write, fsync.

        ``records`` are the fingerprints of the records the round trains on
        (:func:`fingerprints`); they join the ledger's charged records. Returns the
        grant and the ledger with it. The grant is on disk when this returns; a
        refusal leaves the file as it was.
        """
        with self._locked():
            entries = self._read(privacy)
            ledger = self._split(privacy, run, entries)
            grant = decide(ledger)
            self._records |= set(records)
            try:
                self._write(privacy, [*entries, Entry(run, grant)])
            except OSError as error:
                raise LedgerUnavailable(
                    f"the privacy ledger {self.path} cannot be written: {error}"
                ) from None
            ledger.answered.append(grant)
            logger.info(
                "ledger %s: charged run %d round %d (rate=%.6g, sigma=%g, steps=%d)",
                self.path,
                run,
                grant.server_round,
                grant.rate,
                grant.sigma,
                grant.steps,
            )
            return grant, ledger
