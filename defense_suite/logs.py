"""Logging of the ``defense-suite`` command: one level for ``-q``, ``-v`` and ``-vv``.

Library code logs through :func:`logging.getLogger` and never prints; the command
line decides what reaches stderr. By default warnings and errors; off a terminal
(CI, a log file, where no progress bar is drawn) also the suite's own progress
lines, one per arm and seed.

Flower prints its own records: at import it adds a console handler (level INFO,
or ``FLWR_LOG_LEVEL``) to its ``"flwr"`` logger, whose level is DEBUG and which
propagates to the root logger. A record's level is checked against the logger
it was made on, not against the root, so the root handler installed here would
print every Flower line a second time whatever ``-q``/``-v`` say. The root
handler therefore drops Flower's records (:func:`not_flower`), and ``--quiet``
sets Flower's own level to ERROR (:func:`flower_level`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

FORMAT = "%(levelname)s %(name)s: %(message)s"
FLOWER = "flwr"
FLOWER_LEVEL_ENV = "FLWR_LOG_LEVEL"


def level_of(verbose: int, quiet: bool = False) -> int:
    """The root level: ERROR with ``quiet``, else WARNING, INFO (-v), DEBUG (-vv)."""
    if quiet:
        return logging.ERROR
    return logging.WARNING - 10 * min(max(verbose, 0), 2)


def not_flower(record: logging.LogRecord) -> bool:
    """False for a record of the ``flwr`` logger or a child: Flower prints those."""
    return not (record.name == FLOWER or record.name.startswith(FLOWER + "."))


def configure(verbose: int, quiet: bool = False) -> None:
    """Set the root and the ``defense_suite`` loggers for this command."""
    level = level_of(verbose, quiet)
    logging.basicConfig(level=level, format=FORMAT)
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        # exactly what basicConfig installs; capture and file handlers keep all
        if type(handler) is logging.StreamHandler and not_flower not in handler.filters:
            handler.addFilter(not_flower)
    suite = logging.getLogger("defense_suite")
    if quiet:
        suite.setLevel(logging.ERROR)
    elif not sys.stderr.isatty():
        # no progress bar off a terminal: one log line per arm and seed instead
        suite.setLevel(min(logging.INFO, level))
    else:
        suite.setLevel(logging.NOTSET)


@contextlib.contextmanager
def flower_level(quiet: bool) -> Iterator[None]:
    """With ``quiet``, Flower's console prints errors only while the block runs.

    Flower reads ``FLWR_LOG_LEVEL`` when it is imported (lazily, deep in a run)
    and so do the processes ``flwr run`` starts; a Flower already imported gets
    the level directly. A ``FLWR_LOG_LEVEL`` the user set is left as it is. The
    previous state is restored afterwards, so calling the command in-process
    (tests, a notebook) leaves no trace.
    """
    if not quiet or FLOWER_LEVEL_ENV in os.environ:
        yield
        return
    os.environ[FLOWER_LEVEL_ENV] = "ERROR"
    flower = sys.modules.get("flwr.supercore.logger")
    handler: logging.Handler | None = getattr(flower, "console_handler", None)
    before = handler.level if handler is not None else None
    if handler is not None:
        handler.setLevel(logging.ERROR)
    try:
        yield
    finally:
        os.environ.pop(FLOWER_LEVEL_ENV, None)
        flower = sys.modules.get("flwr.supercore.logger")
        imported: logging.Handler | None = getattr(flower, "console_handler", None)
        if imported is not None:  # imported in the block: Flower's default, INFO
            imported.setLevel(logging.INFO if before is None else before)
