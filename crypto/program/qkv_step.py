r"""One encrypted LoRA step on the Q, K, V of a converted BERT's last blocks.

What is trained: the rank-``r`` LoRA factors :math:`A_x, B_x` (:math:`x \in
\{q, k, v\}`) of the last ``blocks`` encoder blocks (default 1: the **last**
block only; ``blocks = n_layers``: every block); the earlier blocks, the
embeddings, the public weights, the pooler and the classifier stay frozen. What
runs encrypted: the whole encoder forward pass (the client's embeddings, mask and
every block's LoRA factors encrypted), the backward pass of :func:`lora_gradients`
(:mod:`crypto.program.backward`) through the trained blocks (the tanh polynomial,
both polynomial LayerNorms as evaluated, the activation polynomial, the
Gaussian-kernel attention and, between trained blocks, the residual and the
Q/K/V projections) and the gradient sums. The key owner refreshes, rolls and
unrolls (function-call path, as :func:`crypto.protocol.finetune.encrypted_step`;
:class:`crypto.protocol.tuning_client.BertTuningClient` runs the same step as
messages), decrypts
six gradient matrices per trained block and updates its factors,
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_real

from ..he.ckks import CKKSParams
from ..he.evaluator import Evaluator, Roll, Value
from .backward import Trained, Unroll, backward, loss_gradient, train_forward
from .bounds import DEFAULT_BOUNDS, UpdateBounds, bound_update
from .encoder import LORA, BertWeights, lora_factors
from .forward import Lora, Run
from .inputs import pack_inputs
from .owner import StepOwner
from .shadow import flag_ids, pack_ids, report
from .spec import from_bert

if TYPE_CHECKING:
    from ..conversion.model import HEBert

NAMES = tuple(f"{x}_{f}" for x in LORA for f in "ab")
"""The trained factors of one block: ``q_a, q_b, k_a, k_b, v_a, v_b``."""


def lora_gradients(
    ev: Evaluator,
    w: BertWeights,
    z: list[Value],
    masks: list[Value],
    lora: Lora,
    roll: Roll,
    unroll: Unroll,
    Y: list[Value],
    m: FloatArray,
    trained: int = 1,
) -> dict[str, list[list[Value]]]:
    """Encrypted gradient sums of the last ``trained`` blocks' Q/K/V factors.

    :mod:`crypto.program.backward` on :func:`~crypto.program.spec.from_bert`: keys
    ``"layer {i} q_a"`` ... ``"layer {i} v_b"``; ``Y`` the one-hot targets on the
    CLS slots, ``m`` the public loss mask; ``lora`` the folded factors of every
    block (the earlier blocks run forward only).
    """
    if len(z) != w.d or len(masks) != w.n_tokens:
        raise ValueError(f"expected {w.d} feature and {w.n_tokens} key-weight values")
    p, t = from_bert(w), Trained(trained)
    run = Run(ev, lora, roll, masks=masks)
    logits = train_forward(run, p, z, t)
    return backward(run, p, loss_gradient(ev, logits, Y, m), unroll, t)


@dataclass(frozen=True)
class QKVStep:
    r"""The last block's factors after one step, their gradients, seconds, counts.

    ``factors`` and ``grads`` are keyed ``"layer {i} q_a"`` ... and use the
    model's convention (``lora_a`` of shape (d, r), ``lora_b`` (r, d), no
    :math:`\kappa`); ``layers`` are the trained blocks. ``factors`` are within
    ``bounds`` of the factors before the step (:mod:`crypto.program.bounds`);
    ``clipped`` counts the entries the bounds changed (0 in an honest step).
    """

    layers: tuple[int, ...]
    factors: dict[str, FloatArray]
    grads: dict[str, FloatArray]
    seconds: float
    counts: dict[str, int]
    bounds: UpdateBounds = DEFAULT_BOUNDS
    clipped: int = 0


def _parameters(model: HEBert, layers: tuple[int, ...]) -> dict[str, Any]:
    """The LoRA parameters of ``layers``, keyed ``"layer {i} q_a"`` ..."""
    out = {}
    for i in layers:
        layer = model.block_list()[i]
        for x, m in zip(LORA, (layer.query, layer.key, layer.value), strict=True):
            out[f"layer {i} {x}_a"] = m.lora_a
            out[f"layer {i} {x}_b"] = m.lora_b
    return out


def trained_layers(model: HEBert, blocks: int) -> tuple[int, ...]:
    """The last ``blocks`` block indices, or a clear error."""
    total = len(model.block_list())
    if isinstance(blocks, bool) or not isinstance(blocks, int):
        raise TypeError(f"blocks must be an int, got {type(blocks).__name__}")
    if not 1 <= blocks <= total:
        raise ValueError(f"blocks: expected 1 to {total} trained blocks, got {blocks}")
    return tuple(range(total - blocks, total))


def current_factors(model: HEBert, blocks: int = 1) -> dict[str, FloatArray]:
    """The last ``blocks`` blocks' LoRA factors, model convention."""
    return {
        k: np.asarray(p.detach().numpy(), dtype=np.float64).copy()
        for k, p in _parameters(model, trained_layers(model, blocks)).items()
    }


def apply_qkv_step(model: HEBert, step: QKVStep) -> None:
    """Write the step's factors into the model (the client's update).

    The factors are bounded again against the model's current ones
    (:func:`crypto.program.bounds.bound_update` with ``step.bounds``: idempotent for a
    step made from this model), so whatever a step holds, the model moves by at
    most the public bounds and never to a non-finite value.
    """
    import torch

    params = _parameters(model, step.layers)
    if set(params) != set(step.factors):
        raise ValueError("the step's factors do not match the model's blocks")
    old = {
        k: np.asarray(p.detach().numpy(), dtype=np.float64) for k, p in params.items()
    }
    new, _ = bound_update(old, step.factors, step.bounds)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(torch.as_tensor(new[k]))


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


def step_inputs(
    model: HEBert,
    ids: npt.ArrayLike,
    mask: npt.ArrayLike | None,
    y: npt.ArrayLike,
    slots: int,
    guard: bool = True,
) -> tuple[list[FloatArray], FloatArray, FloatArray, int]:
    """The client's plaintexts of one step: inputs, targets, loss mask, batch.

    The inputs are the packed features then the ``n`` key weights
    (:func:`crypto.program.inputs.pack_inputs`); the targets are one-hot on the CLS
    slots of the batch's first copy, where the mask :func:`loss_mask` is ``1/B``.
    ``guard=False``: the range verdict is advisory (logged,
    :mod:`crypto.program.shadow`) instead of a ``RangeError`` (the encrypted steps: a
    refusal there would depend on weights an earlier step let the server influence).
    """
    if guard:
        z, masks, batch = pack_inputs(model, ids, mask, slots)
    else:
        report(flag_ids(model, ids, mask), "sequences of the step")
        z, masks, batch = pack_ids(model, ids, mask, slots)
    labels = _labels(model, y, batch)
    n = model.config.n_tokens
    targets = np.zeros((model.config.n_classes, slots))
    targets[labels, np.arange(batch) * n] = 1.0
    return [*z, *masks], targets, loss_mask(batch, n, slots), batch


def loss_mask(batch: int, n: int, slots: int) -> FloatArray:
    """``1/B`` on the CLS slots of the batch's first copy, 0 elsewhere (public)."""
    m = np.zeros(slots)
    m[: batch * n : n] = 1.0 / batch
    return m


def updated(
    model: HEBert,
    grads: dict[str, FloatArray],
    lr: float,
    blocks: int,
    seconds: float,
    counts: dict[str, int],
    bounds: UpdateBounds = DEFAULT_BOUNDS,
) -> QKVStep:
    r"""The client's update from the decrypted (folded) gradient sums.

    :math:`\bar A = \kappa\,\bar A_{\text{folded}}` for Q and K, then
    :math:`A \leftarrow A - \eta \bar A`, :math:`B \leftarrow B - \eta \bar B`,
    each matrix's change bounded by the public ``bounds`` (non-finite entries of
    the change to 0, then per entry and in norm: :func:`crypto.program.bounds.
    bound_update`) before it is returned, whatever the gradients hold.
    """
    layers = trained_layers(model, blocks)
    w = BertWeights.from_model(model)
    plain = {k: np.array(v, dtype=np.float64) for k, v in grads.items()}
    for i in layers:
        for x in ("q", "k"):
            plain[f"layer {i} {x}_a"] *= w.blocks[i].kappa
    old = current_factors(model, blocks)
    with np.errstate(over="ignore", invalid="ignore"):
        raw = {k: old[k] - lr * plain[k] for k in old}
    new, clipped = bound_update(old, raw, bounds)
    return QKVStep(layers, new, plain, seconds, counts, bounds, clipped)


def _step(
    model: HEBert,
    ids: npt.ArrayLike,
    mask: npt.ArrayLike | None,
    y: npt.ArrayLike,
    lr: float,
    owner: StepOwner,
    blocks: int,
    bounds: UpdateBounds = DEFAULT_BOUNDS,
) -> QKVStep:
    lr = check_real("lr", lr, 0.0)
    layers = trained_layers(model, blocks)
    start = time.perf_counter()
    inputs, targets, m, _ = step_inputs(model, ids, mask, y, owner.slots, guard=False)
    w = BertWeights.from_model(model)
    ev, calls = owner.calls(w.n_tokens)
    lora = {k: calls.matrix(M) for k, M in lora_factors(model).items()}
    values = calls.values(inputs)
    grads = lora_gradients(
        ev,
        w,
        values[: w.d],
        values[w.d :],
        lora,
        calls.roll,
        calls.unroll,
        calls.values(targets),
        m,
        len(layers),
    )
    plain = {k: calls.read(G) for k, G in grads.items()}
    seconds = time.perf_counter() - start
    return updated(model, plain, lr, blocks, seconds, dict(ev.counts), bounds)


def simulated_qkv_step(
    model: HEBert,
    ids: npt.ArrayLike,
    y: npt.ArrayLike,
    lr: float,
    mask: npt.ArrayLike | None = None,
    max_level: int = 10**6,
    blocks: int = 1,
    bounds: UpdateBounds = DEFAULT_BOUNDS,
) -> QKVStep:
    """The step in float64 (the HE program on NumpyBackend, no encryption).

    ``max_level`` set to a chain's levels counts the refreshes it would need;
    ``blocks`` is how many of the last blocks are trained; ``bounds`` the public
    update bounds (:mod:`crypto.program.bounds`).
    """
    owner = StepOwner.float64(model, ids, mask, max_level)
    return _step(model, ids, mask, y, lr, owner, blocks, bounds)


def encrypted_qkv_step(
    model: HEBert,
    ids: npt.ArrayLike,
    y: npt.ArrayLike,
    lr: float,
    params: CKKSParams,
    mask: npt.ArrayLike | None = None,
    blocks: int = 1,
    bounds: UpdateBounds = DEFAULT_BOUNDS,
) -> QKVStep:
    """The step under CKKS (TenSEAL, Galois keys for the slot sums).

    Function-call path (no server): ``bounds`` are the client's public update
    bounds (:mod:`crypto.program.bounds`); over messages,
    :class:`~crypto.protocol.tuning_client.BertTuningClient` states them in the
    agreement.
    """
    owner = StepOwner.ckks(model, params)
    return _step(model, ids, mask, y, lr, owner, blocks, bounds)


def reference_qkv_step(
    model: HEBert,
    ids: npt.ArrayLike,
    y: npt.ArrayLike,
    lr: float,
    mask: npt.ArrayLike | None = None,
    blocks: int = 1,
) -> QKVStep:
    """The same step by ``torch`` autograd on the polynomial-mode ``HEBert``."""
    import torch

    lr = check_real("lr", lr, 0.0)
    layers = trained_layers(model, blocks)
    ids_t, mask_t = model.check_ids(ids, mask)
    labels = _labels(model, y, ids_t.shape[0])
    start = time.perf_counter()
    params = _parameters(model, layers)
    logits = model(ids_t, mask_t, poly=True)
    target = torch.nn.functional.one_hot(
        torch.as_tensor(labels), model.config.n_classes
    ).to(torch.float64)
    loss = 0.5 * ((logits - target) ** 2).sum(1).mean()
    found = torch.autograd.grad(loss, list(params.values()))
    grads = {
        k: np.asarray(g.detach().numpy(), dtype=np.float64)
        for k, g in zip(params, found, strict=True)
    }
    old = current_factors(model, blocks)
    new = {k: old[k] - lr * grads[k] for k in old}
    seconds = time.perf_counter() - start
    return QKVStep(layers, new, grads, seconds, {})
