r"""The fine-tuning arms and their weights, folded for the packed layer.

An :class:`Arm` says what is trained (``lora``: the LoRA factors of Q, K, V and the
head; ``full``: every weight matrix) and which attention the layer uses (the
Gaussian kernel or the polynomial-softmax baseline). :func:`plain_net` folds the
public scale factors :math:`c` into each matrix (:math:`\kappa` into Q and K,
:math:`1/B_p` into the pooler, the LayerNorm gain into :math:`W_1`) so every
polynomial sees inputs on its fitted range; an SGD step on the folded matrix with
learning rate :math:`\eta c^2` is the model's own step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from defenses.arrays import FloatArray

from ..he.approx import exp_poly, reciprocal_poly
from .heformer import HEWeights, SoftmaxPolys, lora_factors
from .net import FULL_TRAINED, LORA_TRAINED, Matrix, Net

if TYPE_CHECKING:
    import torch

    from ..models.heformer import HEFormer

ARMS = ("lora", "full")


@dataclass(frozen=True)
class Arm:
    """What one fine-tuning arm trains and which attention it uses."""

    trained: str = "lora"
    attention: str = "gk"

    def __post_init__(self) -> None:
        if self.trained not in ARMS:
            raise ValueError(f"Arm.trained must be one of {ARMS}, got {self.trained!r}")
        if self.attention not in ("gk", "softmax"):
            raise ValueError(
                f"Arm.attention must be 'gk' or 'softmax', got {self.attention!r}"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """The trained matrices."""
        return LORA_TRAINED if self.trained == "lora" else FULL_TRAINED


LORA_GK = Arm()
"""The paper's arm: LoRA with Gaussian-kernel attention."""


def _np(t: torch.Tensor) -> FloatArray:
    return np.asarray(t.detach().numpy(), dtype=np.float64).copy()


def _softmax_polys(model: HEFormer, X: FloatArray) -> tuple[SoftmaxPolys, float]:
    """Polynomials of the softmax baseline calibrated on ``X``; the query scale."""
    import torch

    c = model.config
    with torch.no_grad():
        z = model.embed_tokens(torch.as_tensor(X, dtype=torch.float64))
        b, n = z.shape[0], c.n_tokens
        q = model.q(z).view(b, n, c.heads, c.head_dim).transpose(1, 2)
        k = model.k(z).view(b, n, c.heads, c.head_dim).transpose(1, 2)
        logits = (q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)).numpy()
    r = float(np.abs(logits).max()) * 1.25
    sums = np.exp(logits).sum(-1)
    scale = 1.0 / (float(sums.max()) * 1.25)
    lo = float(sums.min()) * scale / 1.25
    polys = SoftmaxPolys(
        scale * exp_poly(r).coefficients, reciprocal_poly(lo).coefficients
    )
    return polys, 1.0 / (math.sqrt(c.head_dim) * r)


def plain_net(model: HEFormer, arm: Arm, X: FloatArray) -> tuple[Net, dict[str, Any]]:
    """The folded plaintext weights of ``arm`` and each matrix's fold factor ``c``.

    ``X`` calibrates the softmax baseline's polynomials (unused for the kernel).
    """
    w = HEWeights.from_model(model)
    cal = model.calibration
    k_ln = 1.0 / math.sqrt(model.config.d * cal.ln_div)
    gain = _np(model.gamma) / (2.0 * k_ln * math.sqrt(cal.ln_div) * cal.ffn_bound)
    qk = w.kappa
    polys = None
    if arm.attention == "softmax":
        polys, qk = _softmax_polys(model, X)
    fold: dict[str, Any] = {
        "wq": qk,
        "wk": w.kappa if arm.attention == "gk" else 1.0,
        "wv": 1.0,
        "wo": 1.0,
        "w1": gain[:, None],
        "w2": 1.0,
        "pool": 1.0 / cal.pool_bound,
        "classifier": 1.0,
    }
    raw = {
        "wq": _np(model.q.weight),
        "wk": _np(model.k.weight),
        "wv": _np(model.v.weight),
        "wo": w.wo,
        "w1": _np(model.w1),
        "w2": w.w2,
        "pool": _np(model.pool),
        "classifier": _np(model.classifier),
    }
    mats: dict[str, Matrix] = {}
    if arm.trained == "lora":
        factors = lora_factors(model)
        for name in "qkv":
            a = _np(getattr(model, name).lora_a)
            mats[f"{name}_a"] = a * fold[f"w{name}"]
            mats[f"{name}_b"] = factors[f"{name}_b"]
            fold[f"{name}_a"], fold[f"{name}_b"] = fold[f"w{name}"], 1.0
    else:
        for name in "qkv":
            layer = getattr(model, name)
            raw[f"w{name}"] = raw[f"w{name}"] + _np(layer.lora_a) @ _np(layer.lora_b)
    for name, value in raw.items():
        mats[name] = np.asarray(value * fold[name], dtype=np.float64)
    net = Net(
        attention=arm.attention,
        heads=model.config.heads,
        n_tokens=model.config.n_tokens,
        mats=mats,
        trained=arm.names,
        centre=w.centre,
        act=w.act,
        isqrt=w.isqrt,
        tanh=w.tanh,
        gk=w.gk,
        softmax=polys,
    )
    return net, fold


def effective_weights(model: HEFormer, arm: Arm) -> dict[str, FloatArray]:
    """The arm's trained matrices in the model's parametrisation (nothing folded).

    For the full arm, Q, K and V are :math:`W_0 + AB` (the LoRA update merged).
    """
    out: dict[str, FloatArray] = {}
    for name in arm.names:
        if name in ("wq", "wk", "wv"):
            layer = getattr(model, name[1])
            out[name] = _np(layer.weight) + _np(layer.lora_a) @ _np(layer.lora_b)
        elif name[1:] in ("_a", "_b"):
            layer = getattr(model, name[0])
            out[name] = _np(layer.lora_a if name.endswith("a") else layer.lora_b)
        else:
            out[name] = _np(getattr(model, "out" if name == "wo" else name))
    return out


def initial_weights(model: HEFormer, arm: Arm = LORA_GK) -> dict[str, FloatArray]:
    """The trained matrices before the step (model parametrisation)."""
    return effective_weights(model, arm)
