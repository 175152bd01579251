"""What crosses the wire and what stays in the client's state, as Flower records.

The strategy wrapper adds four keys to each node's train config: ``dp-round``,
``dp-rate``, ``dp-sigma`` and ``dp-steps``. The client keeps its ledger in
``context.state["dp-ledger"]`` and the round it granted last in
``context.state["dp-grant"]``; its reply's MetricRecord gets ``dp-epsilon`` (its own
ledger's epsilon) and ``dp-budget``. A client's privacy agreement is read from its own
configuration with :func:`privacy_from_config`; keys are hyphenated as in Flower's
node and run configs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict

from ..ledger import ClientPrivacy, Grant, PrivacyLedger

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


def privacy_from_config(
    values: Mapping[str, object], defaults: Mapping[str, object] | None = None
) -> ClientPrivacy:
    """A client's agreement from its own config (``epsilon``, ``delta``, ...).

    ``defaults`` fills keys the config does not set (the simulation's stand-in).
    Raises TypeError or ValueError naming the key.
    """
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


def load_ledger(context: Context, privacy: ClientPrivacy) -> PrivacyLedger:
    """The client's ledger from its state (empty at the first round)."""
    record = context.state.get(LEDGER)
    if record is None:
        return PrivacyLedger(privacy)
    if not isinstance(record, ConfigRecord):
        raise ValueError(f"context.state[{LEDGER!r}] is not a ConfigRecord")
    return PrivacyLedger.from_state(privacy, dict(record))


def save_ledger(
    context: Context, ledger: PrivacyLedger, grant: Grant, msg: Message
) -> None:
    """Store the ledger, and the grant tied to the message it answers."""
    context.state[LEDGER] = ConfigRecord(dict(ledger.state()))
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


def refusal(msg: Message, reason: str) -> Message:
    """An error reply to ``msg``: no arrays, no metrics, only the reason."""
    return Message(Error(code=REFUSED, reason=reason), reply_to=msg)


def content_with_privacy(content: RecordDict, ledger: PrivacyLedger) -> RecordDict:
    """``content`` whose single MetricRecord also holds epsilon and budget."""
    metrics = list(content.metric_records.items())
    if len(metrics) != 1:
        raise ValueError(
            f"a train reply must hold exactly one MetricRecord, got {len(metrics)}"
        )
    name, record = metrics[0]
    record[EPSILON] = ledger.epsilon
    record[BUDGET] = float(ledger.privacy.epsilon)
    content[name] = record
    return content
