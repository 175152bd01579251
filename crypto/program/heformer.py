r"""The HEFormer's encrypted inference: its public weights, secret factors, simulation.

The program itself is the one of every model family (:mod:`crypto.program`): the
HEFormer is a converted BERT without biases, without the post-attention and output
LayerNorms and with one block (:func:`crypto.program.from_heformer`). Layout
(rotation-free, research note Sec. 5.1): one value per feature; slot ``b * n + i``
holds token ``i`` of sequence ``b``; attention reads ``n`` *rolled* copies of K and
V (:mod:`crypto.program.attention`, re-exported here with the softmax baseline).

The same code runs on the plaintext :class:`~crypto.he.evaluator.NumpyBackend` (the HE
simulation) and on the TenSEAL backend of :mod:`crypto.he.ckks`, through the
level-tracking :class:`~crypto.he.evaluator.Evaluator` of :mod:`crypto.he.evaluator`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from defenses.arrays import FloatArray
from defenses.checks import check_int

from .. import program
from ..he.evaluator import Evaluator, NumpyBackend, Roll, Value
from ..he.packing import pack
from . import simulation
from .attention import SoftmaxPolys, gk_attention, softmax_attention
from .forward import Trace

__all__ = [
    "HEWeights",
    "SoftmaxPolys",
    "forward",
    "gk_attention",
    "lora_factors",
    "simulate",
    "softmax_attention",
]

if TYPE_CHECKING:
    import torch

    from ..models.heformer import HEFormer


@dataclass(frozen=True)
class HEWeights:
    r"""The public, HE-ready weights of a :class:`~crypto.models.heformer.HEFormer`.

    Scales are folded into the public matrices so every polynomial sees inputs in
    [0, 1] or [-1, 1]: :math:`\\kappa = (2\\sqrt{d_h} D)^{-1/2}` into :math:`W_q, W_k`
    (and the client folds it into the LoRA factors it encrypts); the LayerNorm
    centring and :math:`(d\\cdot\\text{div})^{-1/2}` into one matrix; the LayerNorm
    gain, Newton's 1/2 and :math:`1/B_{\\text{ffn}}` into :math:`W_1`;
    :math:`1/B_p` into the pooler. A personal head (``personal_head``) is the
    client's secret and is left out (zeros): it travels encrypted with the LoRA
    factors.
    """

    n_tokens: int
    d: int
    heads: int
    n_classes: int
    embed: FloatArray
    position: FloatArray
    wq: FloatArray
    wk: FloatArray
    wv: FloatArray
    wo: FloatArray
    centre: FloatArray
    w1: FloatArray
    act: FloatArray
    w2: FloatArray
    pool: FloatArray
    classifier: FloatArray
    gk: FloatArray
    isqrt: FloatArray
    tanh: FloatArray
    kappa: float
    ffn_bound: float

    @classmethod
    def from_model(cls, model: HEFormer) -> HEWeights:
        """Extract and fold the weights of a calibrated Gaussian-kernel model."""
        c, cal = model.config, model.calibration
        if c.attention != "gk":
            raise ValueError("encrypted inference needs the Gaussian-kernel model")
        if not cal.calibrated:
            raise ValueError("calibrate the model before extracting HE weights")

        def a(t: torch.Tensor) -> FloatArray:
            return np.asarray(t.detach().numpy(), dtype=np.float64).copy()

        kappa = 1.0 / math.sqrt(2.0 * math.sqrt(c.head_dim) * cal.dist_bound)
        k_ln = 1.0 / math.sqrt(c.d * cal.ln_div)
        centre = (np.eye(c.d) - 1.0 / c.d) * k_ln
        gain = a(model.gamma) / (2.0 * k_ln * math.sqrt(cal.ln_div) * cal.ffn_bound)
        alpha, beta = a(model.act)
        head = 0.0 if c.personal_head else 1.0  # a personal head is the client's
        return cls(
            n_tokens=c.n_tokens,
            d=c.d,
            heads=c.heads,
            n_classes=c.n_classes,
            embed=a(model.embed),
            position=a(model.position),
            wq=a(model.q.weight) * kappa,
            wk=a(model.k.weight) * kappa,
            wv=a(model.v.weight),
            wo=a(model.out),
            centre=centre,
            w1=gain[:, None] * a(model.w1),
            act=np.array([0.0, alpha * cal.ffn_bound, beta * cal.ffn_bound**2]),
            w2=a(model.w2),
            pool=head * a(model.pool) / cal.pool_bound,
            classifier=head * a(model.classifier),
            gk=cal.polys["gk"].coefficients.copy(),
            isqrt=cal.polys["isqrt"].coefficients.copy(),
            tanh=cal.polys["tanh"].coefficients.copy(),
            kappa=kappa,
            ffn_bound=cal.ffn_bound,
        )


def lora_factors(model: HEFormer) -> dict[str, FloatArray]:
    r"""The client's secret weights, with :math:`\\kappa` folded into Q and K.

    The LoRA factors, plus the pooler (divided by :math:`B_p`) and classifier when
    the head is personal.
    """
    kappa = 1.0 / math.sqrt(
        2.0 * math.sqrt(model.config.head_dim) * model.calibration.dist_bound
    )
    out = {}
    for name, layer, s in (
        ("q", model.q, kappa),
        ("k", model.k, kappa),
        ("v", model.v, 1.0),
    ):
        out[f"{name}_a"] = (
            np.asarray(layer.lora_a.detach().numpy(), dtype=np.float64) * s
        )
        out[f"{name}_b"] = np.asarray(
            layer.lora_b.detach().numpy(), dtype=np.float64
        ).copy()
    if model.config.personal_head:
        pool = np.asarray(model.pool.detach().numpy(), dtype=np.float64)
        out["pool"] = pool / model.calibration.pool_bound
        out["classifier"] = np.asarray(
            model.classifier.detach().numpy(), dtype=np.float64
        ).copy()
    return out


def forward(
    ev: Evaluator,
    w: HEWeights,
    z: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll | None = None,
    rolled_z: list[list[Value]] | None = None,
    trace: Trace | None = None,
) -> list[Value]:
    """Encrypted (or simulated) logits on every slot; the CLS slots are the answer.

    Give ``roll`` (interactive: the key owner returns rolled fresh copies of K and V)
    or ``rolled_z`` (non-interactive: the client uploaded rolled copies of the
    embedding, and K, V are projected once per shift). The program of
    :func:`crypto.program.forward` on :func:`crypto.program.from_heformer`;
    ``trace`` receives its activations.
    """
    run = program.Run(ev, lora, roll, rolled_z, trace=trace)
    return program.forward(run, program.from_heformer(w), z)


def simulate(
    model: HEFormer,
    X: FloatArray,
    noise: float = 0.0,
    rng: np.random.Generator | None = None,
    max_level: int = 10**6,
    interactive: bool = True,
) -> tuple[FloatArray, dict[str, int]]:
    """HE simulation of :func:`forward` in float64: (CLS logits, operation counts).

    Inputs outside the model's calibrated ranges are refused (``RangeError``), as
    the client refuses them before encrypting.
    """
    import torch

    from ..models.train import predict_logits

    predict_logits(model, X, guard=True)  # refuses bad shapes, values and ranges
    X = np.asarray(X, dtype=np.float64)
    check_int("max_level", max_level, 1)
    with torch.no_grad():
        z = model.embed_tokens(torch.as_tensor(X, dtype=torch.float64)).numpy()
    w = HEWeights.from_model(model)
    return simulation.simulate(
        program.from_heformer(w),
        pack(z, z.shape[0] * w.n_tokens),
        lora_factors(model),
        z.shape[0],
        max_level,
        NumpyBackend(noise, rng),
        interactive,
    )
