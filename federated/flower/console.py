"""Flower's log lines printed once in the app's processes.

Flower prints its records itself: at import it adds a console handler to its
``"flwr"`` logger, which also propagates to the root logger. A root handler of
class :class:`logging.StreamHandler` therefore prints every Flower line a second
time. The app's processes get one without asking: Opacus's
``opacus.utils.module_utils`` calls :func:`logging.basicConfig` when it is
imported (the first DP round), so from then on each line of ``flwr run --stream``
appeared twice, once in Flower's format (``INFO :      ...``) and once in
Opacus's (``%m/%d/%Y %H:%M:%S:INFO:...``).

:func:`flower_once` imports Opacus now (its ``basicConfig`` runs now, not midway
through a run) and gives every plain root stream handler a :class:`NotFlower`
filter. Flower's own handler stays the one place its lines are printed, at its
own level (``FLWR_LOG_LEVEL``); the propagation itself is kept, so handlers that
collect records (pytest's ``caplog``, a user's file handler) still see them.
"""

from __future__ import annotations

import logging

FLOWER = "flwr"


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
    """Import Opacus (its import-time root handler), then filter the root streams."""
    import opacus.utils.module_utils  # noqa: F401  (side effect: basicConfig)

    filter_root_streams()
