r"""HE-friendly LoRA transformer with CKKS encrypted inference and fine-tuning.

A scaled-down, CPU-only reproduction of Rho et al., "Encryption-Friendly LLM
Architecture", ICLR 2025 (arXiv:2410.02486): a transformer whose attention is the
Gaussian kernel :math:`\\exp(-\\lVert q_i - k_j\\rVert^2 / (2\\sqrt{d_h}))`, whose
non-linearities are low-degree polynomials with calibrated ranges, fine-tuned with
LoRA, and evaluated under CKKS (TenSEAL) between a :class:`~crypto.protocol.Client`
that holds the secret key and a :class:`~crypto.protocol.Server` that holds only a
public context. TenSEAL is imported lazily, so ``import crypto`` never needs it.
"""

from typing import Any

from defenses import __version__ as __version__

_LAZY = {
    "convert": (".conversion", "convert"),
    "distill": (".distill", "distill"),
}
"""Public functions loaded on first use, so ``import crypto`` stays light."""


def __getattr__(name: str) -> Any:
    """``crypto.convert(model, ...)`` and ``crypto.distill(...)``, imported lazily."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    module, attribute = _LAZY[name]
    return getattr(import_module(module, __name__), attribute)
