"""A Flower client mod that enforces the client's budget before the user's code runs.

``ClientApp(mods=[TimeAdaptiveMod(privacy)])``: on every train message the mod reads
the requested round (``dp-round``, ``dp-rate``, ``dp-sigma``, ``dp-steps``), checks it
against the client's own ledger (:meth:`federated.ledger.PrivacyLedger.check`) and
either charges it and calls the user's train function, or answers with an error
reply naming the round, the requested values and the budget: the user's code never
runs and no update leaves the client. On a granted round it adds the ledger's epsilon
and the budget to the reply's metrics (``dp-epsilon``, ``dp-budget``). Its
:meth:`~TimeAdaptiveMod.answer` replies to the strategy wrapper's
``query.dp_agreement`` message with the client's agreement, which lets the server
propose the same schedule the client will verify. ``privacy`` maps
the client's ``Context`` to its agreement (``None``: a client that trains without
DP, by its own configuration). :meth:`TimeAdaptiveMod.register` registers the
agreement query on the user's ClientApp (Flower runs mods only around registered
functions).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from ..ledger import ClientPrivacy, RoundRefused
from . import records
from .client import TimeAdaptiveClient

logger = logging.getLogger(__name__)

PrivacyFn = Callable[[Context], ClientPrivacy | None]


def node_privacy(context: Context) -> ClientPrivacy:
    """The agreement from the node config (``epsilon``, ``delta``, ``sigma``, ...).

    Keys the node config lacks are taken from the run config (the simulation's
    stand-in for a node's own configuration).
    """
    return records.privacy_from_config(
        dict(context.node_config), dict(context.run_config)
    )


class TimeAdaptiveMod:
    """Client mod: refuse any train round the client's ledger does not allow.

    Parameters
    ----------
    privacy : callable, default :func:`node_privacy`
        ``privacy(context)`` gives the client's own agreement, or ``None`` for a
        client that trains without DP.
    """

    def __init__(self, privacy: PrivacyFn = node_privacy) -> None:
        self.privacy = privacy

    def __call__(
        self, msg: Message, ctxt: Context, call_next: ClientAppCallable
    ) -> Message:
        """Check and charge a train message, then pass it on; others unchanged."""
        kind = msg.metadata.message_type
        if kind != MessageType.TRAIN:
            return call_next(msg, ctxt)
        privacy = self.privacy(ctxt)
        if privacy is None:
            return call_next(msg, ctxt)
        client = TimeAdaptiveClient(privacy, ctxt)
        try:
            granted = client.grant(msg)
        except RoundRefused as refused:
            logger.warning("%s", refused)
            return records.refusal(msg, str(refused))
        reply = call_next(msg, ctxt)
        if reply.has_error():
            return reply
        records.content_with_privacy(reply.content, granted.ledger)
        return reply

    def answer(self, msg: Message, ctxt: Context) -> Message:
        """Reply to the strategy wrapper's agreement query with the agreement."""
        privacy = self.privacy(ctxt)
        content = RecordDict()
        if privacy is not None:
            agreement = records.agreement_record(privacy)
            agreement["label"] = str(ctxt.node_config.get("partition-id", ""))
            content[records.AGREEMENT] = agreement
        return Message(content=content, reply_to=msg)

    def register(self, app: ClientApp) -> ClientApp:
        """Register :meth:`answer` as ``app``'s ``query.dp_agreement`` function."""
        app.query(records.AGREEMENT_ACTION)(self.answer)
        return app
