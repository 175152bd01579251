"""Time-adaptive DP for a Flower app: three pieces, on Flower's Message API.

* :class:`TimeAdaptiveMod` - the client mod that checks every train round against
  the client's own ledger before the user's code runs;
* :class:`TimeAdaptiveClient` - the client-side API for the user's training loop
  (the granted round's rate and sigma, Opacus for the user's ``nn.Module``);
* :class:`TimeAdaptiveStrategy` - wraps any Flower strategy so each client gets its
  own round of its own schedule, logs per-client epsilon, fails on a refusal.

The package's own app (``federated.flower.app``) is built on these. Importing this
subpackage imports Flower; ``import federated`` does not.
"""

from ..ledger import ClientPrivacy, PrivacyLedger, RoundRefused
from .client import PrivateRound, TimeAdaptiveClient
from .mod import TimeAdaptiveMod, node_privacy
from .records import privacy_from_config
from .strategy import ClientFailure, TimeAdaptiveStrategy

__all__ = [
    "ClientFailure",
    "ClientPrivacy",
    "PrivacyLedger",
    "PrivateRound",
    "RoundRefused",
    "TimeAdaptiveClient",
    "TimeAdaptiveMod",
    "TimeAdaptiveStrategy",
    "node_privacy",
    "privacy_from_config",
]
