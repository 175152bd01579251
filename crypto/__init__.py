r"""HE-friendly LoRA transformer with CKKS encrypted inference and fine-tuning.

A scaled-down, CPU-only reproduction of Rho et al., "Encryption-Friendly LLM
Architecture", ICLR 2025 (arXiv:2410.02486): a transformer whose attention is the
Gaussian kernel :math:`\\exp(-\\lVert q_i - k_j\\rVert^2 / (2\\sqrt{d_h}))`, whose
non-linearities are low-degree polynomials with calibrated ranges, fine-tuned with LoRA,
and evaluated under CKKS (TenSEAL) between a :class:`~crypto.protocol.client.Client`
that holds the secret key and a :class:`~crypto.protocol.server.Server` that holds only
a public context. TenSEAL is imported lazily, so ``import crypto`` never needs it.
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
    "TuningJob": (".protocol.tuning", "TuningJob"),
    "TuningServer": (".protocol.tuning", "TuningServer"),
    "TuningClient": (".protocol.tuning_client", "TuningClient"),
    "QKVJob": (".protocol.qkv_tuning", "QKVJob"),
    "BertTuningServer": (".protocol.qkv_tuning", "BertTuningServer"),
    "BertTuningClient": (".protocol.qkv_tuning", "BertTuningClient"),
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
