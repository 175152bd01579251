"""What crosses the wire and what stays in the client's state, as Flower records.

The strategy wrapper adds four keys to each node's train config: ``dp-round``,
``dp-rate``, ``dp-sigma`` and ``dp-steps``. The client keeps its lifetime ledger on
its own disk (:func:`federated.flower.runtime.ledger_file`) and the round it granted
last, tied to the message, in ``context.state["dp-grant"]``; its train reply holds
the arrays and one MetricRecord of ``num-examples`` (the agreed public count),
``dp-epsilon`` (its own ledger's epsilon) and ``dp-budget``, nothing else. An error
reply holds only a category (``refused: over-budget``, ``client error``). A
client's privacy agreement is read from its own configuration with
:func:`privacy_from_config`; keys are hyphenated as in Flower's node and run configs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict

from ..ledger import ClientPrivacy, Grant, PrivacyLedger
from .runtime import NodeConfigError

ROUND = "dp-round"
RATE = "dp-rate"
SIGMA = "dp-sigma"
STEPS = "dp-steps"
REQUEST_KEYS = (ROUND, RATE, SIGMA, STEPS)
EPSILON = "dp-epsilon"
BUDGET = "dp-budget"
LEDGER = "dp-ledger"
GRANT = "dp-grant"
AGREEMENT = "dp-agreement"
AGREEMENT_ACTION = "dp_agreement"
REFUSED = 4201
"""Error code of a refused round (outside Flower's own codes)."""
FAILED = 4202
"""Error code of a client-side failure (the details stay in the node's log)."""
NUM_EXAMPLES = "num-examples"
PUBLIC_EXAMPLES = "public-num-examples"
EVALUATE = "evaluate"
EVALUATE_MODES = ("refuse", "public")
PUBLIC_DISJOINT = "public-split-disjoint"
"""Node config (bool): in simulation, the node declares its public evaluate split
disjoint from its training records (else evaluate is refused there)."""
DATA_SEED = "data-seed"
"""Node config (int): the seed of the package app's partition and public split on a
SuperNode (never the run config's ``seed``)."""

PRIVACY_KEYS: dict[str, tuple[str, type]] = {
    "epsilon": ("epsilon", float),
    "delta": ("delta", float),
    "rounds": ("rounds", int),
    "local-steps": ("steps", int),
    "sigma": ("sigma", float),
    "spending": ("spending", str),
    "save-fraction": ("save_fraction", float),
    "save-ratio": ("save_ratio", float),
    "accountant": ("accountant", str),
}
"""Config key -> (ClientPrivacy field, type) of a client's privacy agreement."""


def typed(key: str, value: object, kind: type) -> Any:
    """``value`` as ``kind`` (int for int, int or float for float), else TypeError.

    Booleans are never numbers here, and a float is never silently cut to an int.
    """
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if kind is str and isinstance(value, str):
        return value
    if kind is bool and isinstance(value, bool):
        return value
    raise TypeError(f"{key!r} must be {kind.__name__}, got {value!r}")


DEPLOYMENT_KEYS = (
    "epsilon", "delta", "rounds", "local-steps", "sigma", "spending", "accountant"
)  # fmt: skip
"""Keys a SuperNode's node config must set in a deployment (plus ``save-fraction``
and ``save-ratio`` for ``spending = "time-adaptive"``)."""


class MissingKey(NodeConfigError):
    """A node config lacks a privacy key (a one-line message naming it)."""


def require(values: Mapping[str, object]) -> None:
    """Raise :class:`MissingKey` naming the first deployment key ``values`` lacks."""
    needed = list(DEPLOYMENT_KEYS)
    if values.get("spending", "time-adaptive") == "time-adaptive":
        needed += ["save-fraction", "save-ratio"]
    for key in needed:
        if key not in values:
            raise MissingKey(
                f"this SuperNode's node config lacks {key!r}: in a deployment every "
                f'privacy parameter comes from --node-config "... {key}=..."'
            )


def privacy_from_config(
    values: Mapping[str, object],
    defaults: Mapping[str, object] | None = None,
    *,
    strict: bool = False,
) -> ClientPrivacy:
    """A client's agreement from its own config (``epsilon``, ``delta``, ...).

    ``defaults`` fills keys the config does not set (the simulation's stand-in);
    ``strict`` (a deployment) ignores them and requires every key of
    :data:`DEPLOYMENT_KEYS`. Raises TypeError or ValueError naming the key.
    """
    if strict:
        require(values)
        defaults = None
    merged = {**(defaults or {}), **values}
    kwargs: dict[str, Any] = {}
    for key, (name, kind) in PRIVACY_KEYS.items():
        if key in merged:
            kwargs[name] = typed(key, merged[key], kind)
    missing = [k for k in ("epsilon", "delta", "rounds", "local-steps", "sigma")
               if PRIVACY_KEYS[k][0] not in kwargs]  # fmt: skip
    if missing:
        raise ValueError(f"the client's privacy config lacks {missing}")
    return ClientPrivacy(**kwargs)


def agreement_record(privacy: ClientPrivacy) -> ConfigRecord:
    """The agreement as a ConfigRecord (what the server needs to propose rounds)."""
    return ConfigRecord(
        {key: getattr(privacy, name) for key, (name, _) in PRIVACY_KEYS.items()}
    )


def save_grant(context: Context, grant: Grant, msg: Message) -> None:
    """Tie the grant to the message it answers (the ledger itself is on disk)."""
    context.state[GRANT] = ConfigRecord(
        {
            "round": grant.server_round,
            "rate": grant.rate,
            "sigma": grant.sigma,
            "steps": grant.steps,
            "message": msg.object_id,
        }
    )


def last_grant(context: Context, msg: Message) -> Grant | None:
    """The round granted for this very message (None if it was not granted)."""
    record = context.state.get(GRANT)
    if not isinstance(record, ConfigRecord) or record.get("message") != msg.object_id:
        return None
    return Grant(
        int(typed("round", record["round"], int)),
        float(typed("rate", record["rate"], float)),
        float(typed("sigma", record["sigma"], float)),
        int(typed("steps", record["steps"], int)),
    )


def request(msg: Message) -> dict[str, object]:
    """The requested round's values from a train message (None where missing)."""
    configs = list(msg.content.config_records.values())
    found: dict[str, object] = dict.fromkeys(REQUEST_KEYS)
    for config in configs:
        for key in REQUEST_KEYS:
            if key in config:
                found[key] = config[key]
    return found


def refusal(msg: Message, category: str, reason: str | None = None) -> Message:
    """An error reply to ``msg``: no arrays, no metrics, only the category.

    ``reason`` (:meth:`federated.ledger.RoundRefused.reason`) may add, for an
    over-budget refusal, the epsilon spent and the budget: functions of the rounds
    granted and the agreement, never of a record.
    """
    text = f"refused: {category}" if reason is None else reason
    return Message(Error(code=REFUSED, reason=text), reply_to=msg)


def failure(msg: Message) -> Message:
    """An error reply to ``msg`` that says only that the client failed."""
    return Message(Error(code=FAILED, reason="client error"), reply_to=msg)


def train_reply(
    msg: Message, reply: Message, ledger: PrivacyLedger | None, examples: int
) -> tuple[Message, list[str]]:
    """The train reply as released: arrays and the accounted metrics only.

    Keeps every ArrayRecord and one MetricRecord holding ``num-examples`` (set to
    the agreed public count ``examples``) and, for a DP client, ``dp-epsilon`` and
    ``dp-budget``. Returns the new reply and the names of what was dropped (other
    metrics, config records: releases the ledger does not account).
    """
    content = RecordDict()
    dropped: list[str] = []
    metric_name = "metrics"
    for name, item in reply.content.items():
        if name in reply.content.array_records:
            content[name] = item
        elif name in reply.content.metric_records:
            metric_name = name
            dropped += [f"{name}.{k}" for k in item if k != NUM_EXAMPLES]
        else:
            dropped.append(name)
    metrics = MetricRecord({NUM_EXAMPLES: examples})
    if ledger is not None:
        metrics[EPSILON] = ledger.epsilon
        metrics[BUDGET] = float(ledger.privacy.epsilon)
    content[metric_name] = metrics
    return Message(content=content, reply_to=msg), dropped
