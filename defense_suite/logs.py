"""Logging of the ``defense-suite`` command: one level for ``-q``, ``-v`` and ``-vv``.

Library code logs through :func:`logging.getLogger` and never prints; the command
line decides what reaches stderr. By default warnings and errors; off a terminal
(CI, a log file, where no progress bar is drawn) also the suite's own progress
lines, one per arm and seed.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(levelname)s %(name)s: %(message)s"


def level_of(verbose: int, quiet: bool = False) -> int:
    """The root level: ERROR with ``quiet``, else WARNING, INFO (-v), DEBUG (-vv)."""
    if quiet:
        return logging.ERROR
    return logging.WARNING - 10 * min(max(verbose, 0), 2)


def configure(verbose: int, quiet: bool = False) -> None:
    """Set the root and the ``defense_suite`` loggers for this command."""
    level = level_of(verbose, quiet)
    logging.basicConfig(level=level, format=FORMAT)
    logging.getLogger().setLevel(level)
    suite = logging.getLogger("defense_suite")
    if quiet:
        suite.setLevel(logging.ERROR)
    elif not sys.stderr.isatty():
        # no progress bar off a terminal: one log line per arm and seed instead
        suite.setLevel(min(logging.INFO, level))
    else:
        suite.setLevel(logging.NOTSET)
