"""A Flower client mod that enforces the client's budget before the user's code runs.

``ClientApp(mods=[TimeAdaptiveMod(privacy)])`` answers for every message the client
receives, and releases only what its ledger accounts:

* **train**: the mod reads the requested round (``dp-round``, ``dp-rate``,
  ``dp-sigma``, ``dp-steps``), checks it against the client's lifetime ledger and
  charges it on disk, atomically under a file lock
  (:meth:`federated.flower.client.TimeAdaptiveClient.grant`), then calls the user's
  train function. The reply it lets out holds the arrays and one MetricRecord of
  ``num-examples`` (the agreed public count: ``public-num-examples`` in the node
  config, else what the ClientApp's code declares public, else 1; never the true
  size of private records), ``dp-epsilon`` and ``dp-budget``; other
  metrics are dropped (they are releases the ledger does not account).
  The arrays are released finite (:func:`federated.release.finite_release`,
  post-processing); a failure of the user's function after the charge replies
  ``client error``, a fixed text: the library's release path
  (:meth:`~federated.flower.client.PrivateRound.make_private`,
  :func:`federated.client.local_train`) never raises because of a record, so that
  reply does not depend on the private data; a user's own code must not either.
* **evaluate**: refused by default (metrics on private records are releases outside
  the accounting). A node opts in with ``evaluate = "public"`` in its node config
  (or the mod's ``evaluate`` argument, the ClientApp's own code) when its evaluate
  function uses only a split it designates as public, and the app declares that
  split (``public_records``): evaluate is refused when the split shares a record
  with any record the ledger has charged for, in any run, or with the records the
  node trains on (``training_records``). In Flower's simulation, where a split
  is a function of the server's run config, evaluate is also refused unless the
  node config (``public-split-disjoint = true``) or the app's code
  (``disjoint_in_simulation=True``) declares it disjoint.
* **query** ``dp_agreement``: the client's agreement (what the server needs to
  propose rounds); other queries are refused.
* **errors**: a refusal replies ``refused: <category>``, any exception ``client
  error``; the details (the round, the values, the traceback) go to the node's own
  log only, never to the server.

``privacy`` maps the client's ``Context`` to its agreement (``None``: a client that
trains without DP, by its own configuration). :func:`node_privacy` takes it from the
node config; in Flower's simulation (and only there, as told by
:func:`federated.flower.runtime.in_simulation`) the run config may stand in for keys
the node config lacks. :meth:`TimeAdaptiveMod.register` registers the agreement
query on the user's ClientApp (Flower runs mods only around registered functions).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy.typing as npt
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from defenses.checks import check_choice, check_int

from ..ledger import ClientPrivacy, RoundRefused
from ..release import finite_release
from ..store import fingerprints
from . import records, runtime
from .client import TimeAdaptiveClient
from .console import flower_once

logger = logging.getLogger(__name__)

PrivacyFn = Callable[[Context], ClientPrivacy | None]
RecordsFn = Callable[[Context], npt.ArrayLike]


def node_privacy(
    context: Context, stand_in: Mapping[str, object] | None = None
) -> ClientPrivacy:
    """The agreement from the node config (``epsilon``, ``delta``, ``sigma``, ...).

    In a deployment every key of :data:`~federated.flower.records.DEPLOYMENT_KEYS`
    must be in the node config (:class:`~federated.flower.records.MissingKey`
    names the first one missing); the run config, which the server sets, is never
    read. In simulation, keys the node config lacks come from ``stand_in`` (default:
    the run config).
    """
    node = dict(context.node_config)
    if not runtime.in_simulation():
        return records.privacy_from_config(node, strict=True)
    defaults = dict(context.run_config) if stand_in is None else dict(stand_in)
    return records.privacy_from_config(node, defaults)


class TimeAdaptiveMod:
    """Client mod: refuse any round, evaluate or query the client's ledger forbids.

    Parameters
    ----------
    privacy : callable, default :func:`node_privacy`
        ``privacy(context)`` gives the client's own agreement, or ``None`` for a
        client that trains without DP.
    evaluate : {"refuse", "public"}
        Default answer to evaluate messages when the node config sets no
        ``evaluate``: refuse, or run the user's evaluate function (which must use
        only a public split).
    public_examples : callable, optional
        ``public_examples(context)``: the count the ClientApp's own code declares
        public when the node config sets no ``public-num-examples`` (``None``: no
        such count; then 1).
    training_records, public_records : callable, optional
        ``f(context)``: the node's training records and its public evaluate split
        (one record per row, as its code loads them); their fingerprints
        (:func:`federated.store.fingerprints`) are charged with each grant and
        compared at evaluate. Without ``public_records`` evaluate is refused.
    disjoint_in_simulation : bool
        The ClientApp's code declares that, in simulation, its public split is
        disjoint from its partitions by construction (both cut from one
        permutation of the run config's seed); the node config's
        ``public-split-disjoint`` overrides it. The fingerprint check still runs.
    """

    def __init__(
        self,
        privacy: PrivacyFn = node_privacy,
        *,
        evaluate: str = "refuse",
        public_examples: Callable[[Context], int | None] | None = None,
        training_records: RecordsFn | None = None,
        public_records: RecordsFn | None = None,
        disjoint_in_simulation: bool = False,
    ) -> None:
        check_choice("evaluate", evaluate, records.EVALUATE_MODES)
        self.privacy = privacy
        self.evaluate = evaluate
        self.declared = public_examples
        self.training_records = training_records
        self.public_records = public_records
        self.disjoint_in_simulation = disjoint_in_simulation

    def evaluate_mode(self, ctxt: Context) -> str:
        """The node's evaluate mode: its node config's, else the mod's default."""
        mode = ctxt.node_config.get(records.EVALUATE, self.evaluate)
        check_choice(f"node config {records.EVALUATE!r}", mode, records.EVALUATE_MODES)
        return str(mode)

    def public_examples(self, ctxt: Context) -> int:
        """The public count sent as ``num-examples``: node config, app, else 1."""
        value = ctxt.node_config.get(records.PUBLIC_EXAMPLES)
        if value is None and self.declared is not None:
            value = self.declared(ctxt)
        if value is None:
            value = 1
        count = int(records.typed(records.PUBLIC_EXAMPLES, value, int))
        check_int(records.PUBLIC_EXAMPLES, count, 1)
        return count

    def __call__(
        self, msg: Message, ctxt: Context, call_next: ClientAppCallable
    ) -> Message:
        """Answer ``msg`` releasing only what the ledger accounts (see the module)."""
        flower_once()  # Flower's lines once, whatever the user's code imports
        kind = msg.metadata.message_type
        try:
            if kind == MessageType.TRAIN:
                return self._train(msg, ctxt, call_next)
            if kind == MessageType.EVALUATE:
                self._check_public_split(ctxt)
                reply = call_next(msg, ctxt)
                return records.failure(msg) if reply.has_error() else reply
            if kind == f"{MessageType.QUERY}.{records.AGREEMENT_ACTION}":
                return call_next(msg, ctxt)
            raise RoundRefused(f"message type {kind!r} is not served", "not-served")
        except RoundRefused as refused:
            logger.warning("%s", refused)
            return records.refusal(msg, refused.category, refused.reason())
        except runtime.NodeConfigError as error:
            logger.error("%s", error)
            return records.refusal(msg, "node-config")
        except Exception:
            logger.exception("the client failed on a %s message", kind)
            return records.failure(msg)

    def _check_public_split(self, ctxt: Context) -> None:
        """Refuse evaluate unless the node's public split is public (see module)."""

        def refuse(why: str) -> RoundRefused:
            return RoundRefused(f"evaluate refused: {why}", "evaluate-refused")

        if self.evaluate_mode(ctxt) != "public":
            raise refuse(
                "metrics on private records are not accounted (opt in with "
                'evaluate="public" for a public split)'
            )
        if self.public_records is None:
            raise refuse("the app declares no public split (public_records)")
        if runtime.in_simulation():
            declared = ctxt.node_config.get(
                records.PUBLIC_DISJOINT, self.disjoint_in_simulation
            )
            if declared is not True:
                raise refuse(
                    "in simulation the split is a function of the run config; the "
                    f"node config must declare {records.PUBLIC_DISJOINT} = true"
                )
        public = set(fingerprints(self.public_records(ctxt)))
        privacy = self.privacy(ctxt)
        used: set[str] = set()
        if privacy is not None:
            used = runtime.ledger_file(ctxt).charged_records(privacy)
        if self.training_records is not None:
            pad = self.public_examples(ctxt)  # the hashing time: public rows
            used |= set(fingerprints(self.training_records(ctxt), pad))
        shared = len(public & used)
        if shared:
            raise refuse(
                f"the public split shares {shared} record(s) with records this "
                "node trains on or was charged for (any run)"
            )

    def _train(
        self, msg: Message, ctxt: Context, call_next: ClientAppCallable
    ) -> Message:
        privacy = self.privacy(ctxt)
        examples = self.public_examples(ctxt)
        ledger = None
        if privacy is not None:
            charged: list[str] = []
            if self.training_records is not None:
                charged = fingerprints(self.training_records(ctxt), examples)
            ledger = TimeAdaptiveClient(privacy, ctxt).grant(msg, charged).ledger
        reply = call_next(msg, ctxt)  # a raise goes to the node's log only
        if reply.has_error():
            logger.error("the user's train function replied %s", reply.error.reason)
            return records.failure(msg)
        for name, record in list(reply.content.array_records.items()):
            arrays = record.to_numpy_ndarrays()
            released = finite_release(arrays)
            if any(a is not b for a, b in zip(arrays, released, strict=True)):
                reply.content[name] = ArrayRecord(
                    array_dict={
                        k: Array(a) for k, a in zip(record, released, strict=True)
                    }
                )
        out, dropped = records.train_reply(msg, reply, ledger, examples)
        if dropped:
            logger.warning("not released (unaccounted): %s", ", ".join(dropped))
        return out

    def answer(self, msg: Message, ctxt: Context) -> Message:
        """Reply to the strategy wrapper's agreement query with the agreement."""
        privacy = self.privacy(ctxt)
        content = RecordDict()
        if privacy is not None:
            agreement = records.agreement_record(privacy)
            agreement["label"] = str(ctxt.node_config.get("partition-id", ""))
            agreement[records.EVALUATE] = self.evaluate_mode(ctxt)
            content[records.AGREEMENT] = agreement
        return Message(content=content, reply_to=msg)

    def register(self, app: ClientApp) -> ClientApp:
        """Register :meth:`answer` as ``app``'s ``query.dp_agreement`` function."""
        app.query(records.AGREEMENT_ACTION)(self.answer)
        return app
