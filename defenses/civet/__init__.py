"""CIVET: certified training and certification of VAEs (Xu et al., ICLR 2025).

Standalone use, on any ``nn.Module`` with ``encode(x) -> (mu, logvar)`` and
``decode(z) -> x_hat`` (:mod:`defenses.civet.protocol`)::

    from defenses.civet import certify, train_vae
    train_vae(my_vae, X, method="civet")
    certify(my_vae, X_test, eps=0.1, p=0.95).bound   # per-input bound

The built-in container (:func:`mlp_vae`, :func:`conv_vae`) is one implementation of
the protocol. See :mod:`defenses.civet.defense` for the trainer,
:mod:`defenses.civet.certificate` for the bound, :mod:`defenses.civet.graph` for
interval propagation through a traced module, :mod:`defenses.civet.attacks` for the
attacks that try to break the certificate, and :mod:`defenses.civet.scenario` for
the harness wiring.
"""

from defenses.civet.bounds import Box, UnsupportedLayerError
from defenses.civet.certificate import Certificate, certify
from defenses.civet.crosscheck import CheckConfig, CheckReport, CrossCheckError
from defenses.civet.crown import crown
from defenses.civet.defense import TrainConfig, TrainLog, train_vae
from defenses.civet.graph import ibp
from defenses.civet.model import VAE, conv_vae, mlp_vae
from defenses.civet.protocol import VAEInterface, as_vae

__all__ = [
    "VAE",
    "Box",
    "Certificate",
    "CheckConfig",
    "CheckReport",
    "CrossCheckError",
    "TrainConfig",
    "TrainLog",
    "UnsupportedLayerError",
    "VAEInterface",
    "as_vae",
    "certify",
    "conv_vae",
    "crown",
    "ibp",
    "mlp_vae",
    "train_vae",
]
