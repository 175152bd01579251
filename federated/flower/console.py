"""Flower's log lines printed once in the app's processes.

Flower prints its records itself: at import it adds a console handler to its
``"flwr"`` logger, which also propagates to the root logger. A root handler of
class :class:`logging.StreamHandler` therefore prints every Flower line a second
time. The app's processes got one without asking: Opacus's
``opacus.utils.module_utils`` calls :func:`logging.basicConfig` when it is
imported (the first DP round), so from then on each line of ``flwr run --stream``
appeared twice, once in Flower's format (``INFO :      ...``) and once in
Opacus's (``%m/%d/%Y %H:%M:%S:INFO:...``), and Flower's DEBUG lines, which its own
handler hides, appeared once.

:func:`flower_once` gives a process without root handlers one of its own first
(the same as ``basicConfig``: stderr, no level), so that Opacus's ``basicConfig``
is a no-op, and gives every plain root stream handler a :class:`NotFlower` filter.
Flower's own handler stays the one place its lines are printed, at its own level
(``FLWR_LOG_LEVEL``). The propagation itself is kept, so handlers that collect
records (pytest's ``caplog``, a user's file handler) still see them.
"""

from __future__ import annotations

import logging

FLOWER = "flwr"
FORMAT = "%(levelname)s %(name)s: %(message)s"


class NotFlower(logging.Filter):
    """Drops the records of the ``flwr`` logger and its children."""

    def filter(self, record: logging.LogRecord) -> bool:
        """True for a record of any other logger."""
        name = record.name
        return not (name == FLOWER or name.startswith(FLOWER + "."))


def filter_root_streams() -> int:
    """Give each plain root stream handler a :class:`NotFlower`; return how many.

    Only handlers of exactly :class:`logging.StreamHandler` (what
    :func:`logging.basicConfig` installs) are touched: subclasses such as file
    handlers and capture handlers keep every record.
    """
    added = 0
    for handler in logging.getLogger().handlers:
        plain = type(handler) is logging.StreamHandler
        if plain and not any(isinstance(f, NotFlower) for f in handler.filters):
            handler.addFilter(NotFlower())
            added += 1
    return added


def flower_once() -> None:
    """A root stderr handler if there is none, then filter the root streams.

    Idempotent and cheap: the app calls it at the start of the ServerApp and of
    every training round of the ClientApp, before Opacus is imported there.
    """
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()  # stderr, as basicConfig would
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    filter_root_streams()
