"""Time-adaptive DP for a Flower app: three pieces, on Flower's Message API.

* :class:`TimeAdaptiveMod` - the client mod that checks every train round against
  the client's own lifetime ledger (a file in the node's storage,
  :class:`federated.store.LedgerFile`) before the user's code runs, refuses
  evaluate unless the node opts in, and releases only accounted fields;
* :class:`TimeAdaptiveClient` - the client-side API for the user's training loop
  (the granted round's rate and sigma, Opacus for the user's ``nn.Module``);
* :class:`TimeAdaptiveStrategy` - wraps any Flower strategy so each client gets its
  own round of its own schedule, logs per-client epsilon, fails on a refusal.

The package's own app (``federated.flower.app``) is built on these. Importing this
subpackage imports Flower; ``import federated`` does not.
"""

from ..ledger import ClientPrivacy, PrivacyLedger, RoundRefused
from . import runtime
from .client import PrivateRound, TimeAdaptiveClient
from .mod import TimeAdaptiveMod, node_privacy
from .records import MissingKey, privacy_from_config
from .runtime import NodeConfigError
from .strategy import BudgetSpent, ClientFailure, TimeAdaptiveStrategy


def in_simulation() -> bool:
    """True inside Flower's simulation (:func:`federated.flower.runtime.in_simulation`).

    Looked up at each call, so a test that stands in for the simulation's actor
    (patching ``runtime.in_simulation``) reaches code that imported this name.
    """
    return runtime.in_simulation()


__all__ = [
    "BudgetSpent",
    "ClientFailure",
    "ClientPrivacy",
    "MissingKey",
    "NodeConfigError",
    "PrivacyLedger",
    "PrivateRound",
    "RoundRefused",
    "TimeAdaptiveClient",
    "TimeAdaptiveMod",
    "TimeAdaptiveStrategy",
    "in_simulation",
    "node_privacy",
    "privacy_from_config",
]
