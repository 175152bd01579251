r"""One encrypted LoRA step on the Q, K, V of a converted BERT's last block.

What is trained: the rank-``r`` LoRA factors :math:`A_x, B_x` (:math:`x \in
\{q, k, v\}`) of the **last** encoder block; every earlier block, the embeddings,
the public weights, the pooler and the classifier stay frozen. What runs
encrypted: the whole encoder forward pass (the client's embeddings, mask and every
block's LoRA factors encrypted), the last block's backward pass of
:func:`crypto.bert_lora.lora_gradients` (through the tanh polynomial, both
polynomial LayerNorms as evaluated, the activation polynomial and the
Gaussian-kernel attention) and the gradient sums. The key owner refreshes, rolls
and unrolls (function-call path, as :func:`crypto.finetune.encrypted_step`),
decrypts the six gradient matrices and updates its factors,
:math:`A \leftarrow A - \eta \bar A`, :math:`B \leftarrow B - \eta \bar B`, in the
model's own convention (the program's :math:`A_q, A_k` carry the block's
:math:`\kappa`, so :math:`\bar A = \kappa\, \bar A_{\text{folded}}`).

The loss is the squared error on the CLS logits,
:math:`L = \tfrac1{2B}\sum_b\lVert \ell_b - \mathrm{onehot}(y_b)\rVert^2`.
:func:`reference_qkv_step` is the same step by ``torch`` autograd on
:class:`~crypto.conversion.model.HEBert` in polynomial mode (the function the HE
program evaluates).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_real

from .bert_lora import lora_gradients
from .bert_pack import pack_inputs
from .ckks import CKKSParams, TenSEALBackend, make_context
from .evaluator import Backend, Evaluator, NumpyBackend, Value
from .finetune import _Services
from .heval_bert import LORA, BertWeights, lora_factors

if TYPE_CHECKING:
    from .conversion.model import HEBert

NAMES = tuple(f"{x}_{f}" for x in LORA for f in "ab")
"""The trained factors: ``q_a, q_b, k_a, k_b, v_a, v_b`` of the last block."""


@dataclass(frozen=True)
class QKVStep:
    r"""The last block's factors after one step, their gradients, seconds, counts.

    ``factors`` and ``grads`` use the model's convention (``lora_a`` of shape
    (d, r), ``lora_b`` (r, d), no :math:`\kappa`); ``layer`` is the trained block.
    """

    layer: int
    factors: dict[str, FloatArray]
    grads: dict[str, FloatArray]
    seconds: float
    counts: dict[str, int]


def current_factors(model: HEBert) -> dict[str, FloatArray]:
    """The last block's LoRA factors, model convention (``q_a`` ... ``v_b``)."""
    layer = model.block_list()[-1]
    out = {}
    for x, m in zip(LORA, (layer.query, layer.key, layer.value), strict=True):
        out[f"{x}_a"] = np.asarray(m.lora_a.detach().numpy(), dtype=np.float64).copy()
        out[f"{x}_b"] = np.asarray(m.lora_b.detach().numpy(), dtype=np.float64).copy()
    return out


def apply_qkv_step(model: HEBert, step: QKVStep) -> None:
    """Write the step's factors into the model's last block (the client's update)."""
    import torch

    layer = model.block_list()[-1]
    if step.layer != len(model.block_list()) - 1:
        raise ValueError(f"the step trained block {step.layer}, not the last one")
    with torch.no_grad():
        for x, m in zip(LORA, (layer.query, layer.key, layer.value), strict=True):
            m.lora_a.copy_(torch.as_tensor(step.factors[f"{x}_a"]))
            m.lora_b.copy_(torch.as_tensor(step.factors[f"{x}_b"]))


def _labels(model: HEBert, y: npt.ArrayLike, batch: int) -> npt.NDArray[np.int64]:
    labels = np.asarray(y)
    k = model.config.n_classes
    if labels.dtype.kind not in "iu" or labels.ndim != 1:
        raise ValueError("y: expected a 1-d array of integer labels")
    if labels.size != batch:
        raise ValueError(f"y: {labels.size} labels for {batch} sequences")
    if labels.size and (labels.min() < 0 or labels.max() >= k):
        raise ValueError(f"y: labels must lie in [0, {k})")
    return labels.astype(np.int64)


def _step(
    model: HEBert,
    ids: npt.ArrayLike,
    mask: npt.ArrayLike | None,
    y: npt.ArrayLike,
    lr: float,
    slots: int,
    backend: Backend,
    max_level: int,
    encrypt: Callable[[FloatArray], Any],
    decrypt: Callable[[Any], FloatArray],
) -> QKVStep:
    lr = check_real("lr", lr, 0.0)
    start = time.perf_counter()
    z, masks, batch = pack_inputs(model, ids, mask, slots)
    labels = _labels(model, y, batch)
    w = BertWeights.from_model(model)
    n, last = w.n_tokens, len(w.blocks) - 1
    services = _Services(encrypt, decrypt, n, slots)
    ev = Evaluator(backend, max_level, services.fresh)
    lora = {
        k: [[Value(encrypt(np.full(slots, x))) for x in row] for row in M]
        for k, M in lora_factors(model).items()
    }
    targets = np.zeros((w.n_classes, slots))
    targets[labels, np.arange(batch) * n] = 1.0
    m = np.zeros(slots)
    m[: batch * n : n] = 1.0 / batch
    grads = lora_gradients(
        ev,
        w,
        [Value(encrypt(v)) for v in z],
        [Value(encrypt(v)) for v in masks],
        lora,
        services.roll,
        services.unroll,
        [Value(encrypt(t)) for t in targets],
        m,
    )
    kappa = w.blocks[last].kappa
    plain = {
        k: np.array([[decrypt(v.handle)[0] for v in row] for row in G])
        for k, G in grads.items()
    }
    for x in ("q", "k"):
        plain[f"{x}_a"] = plain[f"{x}_a"] * kappa
    old = current_factors(model)
    new = {k: old[k] - lr * plain[k] for k in NAMES}
    seconds = time.perf_counter() - start
    return QKVStep(last, new, plain, seconds, dict(ev.counts))


def simulated_qkv_step(
    model: HEBert,
    ids: npt.ArrayLike,
    y: npt.ArrayLike,
    lr: float,
    mask: npt.ArrayLike | None = None,
    max_level: int = 10**6,
) -> QKVStep:
    """The step in float64 (the HE program on NumpyBackend, no encryption).

    ``max_level`` set to a chain's levels counts the refreshes it would need.
    """
    slots = model.check_ids(ids, mask)[0].shape[0] * model.config.n_tokens

    def same(x: FloatArray) -> FloatArray:
        return np.array(x, dtype=np.float64)

    return _step(model, ids, mask, y, lr, slots, NumpyBackend(), max_level, same, same)


def encrypted_qkv_step(
    model: HEBert,
    ids: npt.ArrayLike,
    y: npt.ArrayLike,
    lr: float,
    params: CKKSParams,
    mask: npt.ArrayLike | None = None,
) -> QKVStep:
    """The step under CKKS (TenSEAL, Galois keys for the slot sums)."""
    import tenseal as ts

    ctx = make_context(params, galois=True)
    slots = params.slots - params.slots % model.config.n_tokens

    def encrypt(x: FloatArray) -> Any:
        return ts.ckks_vector(ctx, list(np.asarray(x, dtype=np.float64)))

    def decrypt(handle: Any) -> FloatArray:
        return np.asarray(handle.decrypt(), dtype=np.float64)

    return _step(
        model,
        ids,
        mask,
        y,
        lr,
        slots,
        TenSEALBackend(),
        params.levels,
        encrypt,
        decrypt,
    )


def reference_qkv_step(
    model: HEBert,
    ids: npt.ArrayLike,
    y: npt.ArrayLike,
    lr: float,
    mask: npt.ArrayLike | None = None,
) -> QKVStep:
    """The same step by ``torch`` autograd on the polynomial-mode ``HEBert``."""
    import torch

    lr = check_real("lr", lr, 0.0)
    ids_t, mask_t = model.check_ids(ids, mask)
    labels = _labels(model, y, ids_t.shape[0])
    start = time.perf_counter()
    layer = model.block_list()[-1]
    params = {
        f"{x}_{f}": getattr(m, f"lora_{f}")
        for x, m in zip(LORA, (layer.query, layer.key, layer.value), strict=True)
        for f in "ab"
    }
    logits = model(ids_t, mask_t, poly=True)
    target = torch.nn.functional.one_hot(
        torch.as_tensor(labels), model.config.n_classes
    ).to(torch.float64)
    loss = 0.5 * ((logits - target) ** 2).sum(1).mean()
    found = torch.autograd.grad(loss, [params[k] for k in NAMES])
    grads = {
        k: np.asarray(g.detach().numpy(), dtype=np.float64)
        for k, g in zip(NAMES, found, strict=True)
    }
    old = current_factors(model)
    new = {k: old[k] - lr * grads[k] for k in NAMES}
    seconds = time.perf_counter() - start
    return QKVStep(len(model.block_list()) - 1, new, grads, seconds, {})
