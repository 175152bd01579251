r"""HE-friendly LoRA transformer with CKKS encrypted inference and fine-tuning.

A scaled-down, CPU-only reproduction of Rho et al., "Encryption-Friendly LLM
Architecture", ICLR 2025 (arXiv:2410.02486): a transformer whose attention is the
Gaussian kernel :math:`\\exp(-\\lVert q_i - k_j\\rVert^2 / (2\\sqrt{d_h}))`, whose
non-linearities are low-degree polynomials with calibrated ranges, fine-tuned with LoRA,
and evaluated under CKKS (TenSEAL) between a :class:`~crypto.protocol.client.Client`
that holds the secret key and a :class:`~crypto.protocol.server.Server` that holds only
a public context. TenSEAL is imported lazily, so ``import crypto`` never needs it.

Layers, bottom to top, each importing only those below it (issue 41):

* :mod:`crypto.he` - the CKKS backend: parameters, evaluator, packing, polynomial
  fits, cost model;
* :mod:`crypto.models` - the HE-friendly transformer and its plaintext training;
* :mod:`crypto.conversion` - a user's ``transformers`` model to the HE-friendly
  form, distillation, tokenizer;
* :mod:`crypto.program` - the encrypted program of either model family: forward
  pass, backward pass, SGD steps;
* :mod:`crypto.protocol` - the bytes between the key owner and the server: wire
  format, transports, session, schedule, clients, servers, fine-tuning as messages,
  the reaction red team;
* at the root, the files every package of the suite has: ``tasks``, ``arms``,
  ``attacks``, ``defense``, ``scenario``, ``figures`` and ``benchmark``.

The names the docs teach (``convert``, ``distill``, ``Client``, ``Server``,
``BertClient``, ``InProcess``, ``Loopback``, ``HEFormer``, ...) are attributes of
this package, loaded on first use (:data:`_LAZY`).
"""

from typing import Any

from defenses import __version__ as __version__

_LAZY = {
    "convert": (".conversion", "convert"),
    "distill": (".conversion.distill", "distill"),
    "DistillConfig": (".conversion.distill", "DistillConfig"),
    "build_tokenizer": (".conversion.tokenizer", "build_tokenizer"),
    "HEBert": (".conversion.model", "HEBert"),
    "HEFormer": (".models.heformer", "HEFormer"),
    "ModelConfig": (".models.heformer", "ModelConfig"),
    "TrainConfig": (".models.train", "TrainConfig"),
    "CKKSParams": (".he.ckks", "CKKSParams"),
    "Client": (".protocol.client", "Client"),
    "BertClient": (".protocol.encoder_client", "BertClient"),
    "Server": (".protocol.server", "Server"),
    "InProcess": (".protocol.server", "InProcess"),
    "Loopback": (".protocol.transport", "Loopback"),
    "TuningJob": (".protocol.jobs", "TuningJob"),
    "TuningServer": (".protocol.tuning", "TuningServer"),
    "TuningClient": (".protocol.tuning_client", "TuningClient"),
    "QKVJob": (".protocol.jobs", "QKVJob"),
    "BertTuningServer": (".protocol.tuning", "BertTuningServer"),
    "BertTuningClient": (".protocol.tuning_client", "BertTuningClient"),
}
"""Public names loaded on first use, so ``import crypto`` stays light: the functions
and classes the docs teach, wherever their module lives (issue 41 moved the modules
into ``he/``, ``models/``, ``conversion/``, ``program/`` and ``protocol/``)."""


def __getattr__(name: str) -> Any:
    """``crypto.convert(model, ...)``, ``crypto.distill(...)`` etc., imported lazily."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    module, attribute = _LAZY[name]
    return getattr(import_module(module, __name__), attribute)
