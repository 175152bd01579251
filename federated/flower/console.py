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

A run the strategy wrapper stops (a client refused: its budget is spent, or it
failed) raises :class:`~federated.flower.strategy.ClientFailure`; Flower's runtime
logs any exception out of a ServerApp with its traceback ("ServerApp raised an
exception", "Simulation raised an exception"). :class:`OneLineFailure`, installed
on Flower's logger by :func:`one_line_failures`, turns such a record whose exception
is (or was caused by) a ``ClientFailure`` into one line, ``run stopped: <why>``,
without the traceback; the run's status is still ``finished:failed``.
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


class RunStopped(RuntimeError):
    """A run stopped on purpose (base of ``ClientFailure``): one line, no traceback."""


def _stopping_cause(error: BaseException | None) -> BaseException | None:
    """The first :class:`RunStopped` in ``error``'s cause/context chain, if any."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, RunStopped):
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None


class OneLineFailure(logging.Filter):
    """Rewrites a Flower record carrying a ``ClientFailure`` as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Always keep the record; drop its traceback if a client stopped the run."""
        info = record.exc_info
        cause = _stopping_cause(info[1] if info else None)
        if cause is not None:
            record.msg = "run stopped: %s"
            record.args = (str(cause).splitlines()[0] if str(cause) else "",)
            record.exc_info = None
            record.exc_text = None
        return True


def one_line_failures() -> None:
    """Install :class:`OneLineFailure` on Flower's logger (idempotent)."""
    flwr_logger = logging.getLogger(FLOWER)
    if not any(isinstance(f, OneLineFailure) for f in flwr_logger.filters):
        flwr_logger.addFilter(OneLineFailure())
