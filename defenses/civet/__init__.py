"""CIVET: certified training and certification of VAEs (Xu et al., ICLR 2025).

Standalone use::

    from defenses.civet import mlp_vae, train_vae, certify
    model = mlp_vae(64)
    train_vae(model, X, method="civet")
    certify(model, X_test, eps=0.1, p=0.95).bound   # per-input bound

See :mod:`defenses.civet.defense` for the method, :mod:`defenses.civet.attacks` for
the attacks that try to break the certificate, and :mod:`defenses.civet.scenario`
for the harness wiring.
"""

from defenses.civet.bounds import Box, UnsupportedLayerError
from defenses.civet.certificate import Certificate, certify
from defenses.civet.crown import crown
from defenses.civet.defense import TrainConfig, TrainLog, train_vae
from defenses.civet.graph import ibp
from defenses.civet.model import VAE, conv_vae, mlp_vae

__all__ = [
    "VAE",
    "Box",
    "Certificate",
    "TrainConfig",
    "TrainLog",
    "UnsupportedLayerError",
    "certify",
    "conv_vae",
    "crown",
    "ibp",
    "mlp_vae",
    "train_vae",
]
