r"""One encrypted LoRA step of a converted BERT's classifier, on the encrypted encoder.

What is trained: a rank-``r`` LoRA adapter :math:`A B` on the classifier,
:math:`\ell = p\,(W_c^T + A B) + b_c`, the client's secret, encrypted (one
replicated ciphertext per entry). What runs encrypted: the whole frozen encoder
(:func:`crypto.program.forward.encode`, with the client's encrypted Q/K/V LoRA factors
and mask, the key owner refreshing and rolling K and V), the adapted logits, the
loss gradient and the adapter's gradient sums
(:func:`crypto.program.backward.adapter_gradients`). What is not trained here: the
encoder's LoRA factors (the Q/K/V step of :mod:`crypto.program.qkv_step` trains them
with the same backward pass, :mod:`crypto.program.backward`).

With the squared error on the CLS logits,
:math:`L = \tfrac1{2B}\sum_b\lVert \ell_b - y_b\rVert^2`, and the public mask ``m``
(``1/B`` on the CLS slots of the batch's first copy, 0 elsewhere),
:math:`G = m\odot(\ell - Y)` and

.. math::

    \nabla B_{rc} = \textstyle\sum_t (pA)_r\, G_c, \qquad
    \nabla A_{gr} = \textstyle\sum_t p_g\, (G B^T)_r

(:math:`\sum_t` a slot sum: rotations with Galois keys). The server returns the
encrypted gradients; the key owner decrypts them and updates its adapter,
:math:`A \leftarrow A - \eta\nabla A`, :math:`B \leftarrow B - \eta\nabla B`,
each change bounded by public bounds first (:mod:`crypto.program.bounds`)
(function-call path: the key owner's refresh, roll and decryption are calls, as
in :func:`crypto.protocol.finetune.encrypted_step`). :func:`reference_head_step` is the
same step by ``torch`` autograd on the plaintext polynomial model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_real

from ..he.ckks import CKKSParams
from .backward import adapter_gradients
from .bounds import DEFAULT_BOUNDS, UpdateBounds, bound_update
from .encoder import BertWeights, lora_factors
from .forward import Run, encode
from .owner import StepOwner
from .shadow import flag_ids, pack_ids, report
from .spec import from_bert

if TYPE_CHECKING:
    from ..conversion.model import HEBert


@dataclass(frozen=True)
class HeadStep:
    """The adapter after one step, its gradients, seconds and operation counts.

    ``a`` and ``b`` are within the step's public bounds of the adapter before it
    (:mod:`crypto.program.bounds`); ``clipped`` counts the entries the bounds changed.
    """

    a: FloatArray
    b: FloatArray
    grad_a: FloatArray
    grad_b: FloatArray
    seconds: float
    counts: dict[str, int]
    clipped: int = 0


def _check(
    model: HEBert, y: npt.ArrayLike, A: npt.ArrayLike, B: npt.ArrayLike, lr: float
) -> tuple[npt.NDArray[np.int64], FloatArray, FloatArray, float]:
    c = model.config
    a = np.asarray(A, dtype=np.float64)
    b = np.asarray(B, dtype=np.float64)
    if (
        a.ndim != 2
        or b.ndim != 2
        or a.shape[0] != c.d
        or b.shape
        != (
            a.shape[1],
            c.n_classes,
        )
    ):
        raise ValueError(
            f"A, B: expected shapes ({c.d}, r) and (r, {c.n_classes}), got "
            f"{a.shape} and {b.shape}"
        )
    labels = np.asarray(y)
    if labels.dtype.kind not in "iu" or labels.ndim != 1:
        raise ValueError("y: expected a 1-d array of integer labels")
    if labels.size and (labels.min() < 0 or labels.max() >= c.n_classes):
        raise ValueError(f"y: labels must lie in [0, {c.n_classes})")
    return labels.astype(np.int64), a, b, check_real("lr", lr, 0.0)


def _step(
    model: HEBert,
    ids: npt.ArrayLike,
    mask: npt.ArrayLike | None,
    y: npt.ArrayLike,
    A: npt.ArrayLike,
    B: npt.ArrayLike,
    lr: float,
    owner: StepOwner,
    bounds: UpdateBounds = DEFAULT_BOUNDS,
) -> HeadStep:
    labels, a, b, lr = _check(model, y, A, B, lr)
    if not np.all(np.isfinite(a)) or not np.all(np.isfinite(b)):
        raise ValueError("A, B: the adapter must be finite")
    start = time.perf_counter()
    report(flag_ids(model, ids, mask), "sequences of the step")  # advisory
    slots = owner.slots
    z, masks, batch = pack_ids(model, ids, mask, slots)
    if labels.size != batch:
        raise ValueError(f"y: {labels.size} labels for {batch} sequences")
    w = BertWeights.from_model(model)
    n = w.n_tokens
    ev, calls = owner.calls(n)
    lora = {k: calls.matrix(M) for k, M in lora_factors(model).items()}
    onehot = np.zeros((batch, n, w.n_classes))
    onehot[np.arange(batch), 0, labels] = 1.0
    targets = np.zeros((w.n_classes, slots))
    targets[:, : batch * n] = onehot.reshape(batch * n, -1).T
    m = np.zeros(slots)
    m[: batch * n : n] = 1.0 / batch
    p, zv = from_bert(w), calls.values(z)
    run = Run(ev, lora, calls.roll, masks=calls.values(masks))
    pooled = encode(run, p, zv)
    Y = calls.values(targets)
    grads, _ = adapter_gradients(ev, p, pooled, calls.matrix(a), calls.matrix(b), Y, m)
    ga, gb = calls.read(grads["a"]), calls.read(grads["b"])
    seconds = time.perf_counter() - start
    with np.errstate(over="ignore", invalid="ignore"):
        raw = {"a": a - lr * ga, "b": b - lr * gb}
    new, clipped = bound_update({"a": a, "b": b}, raw, bounds)
    counts = dict(ev.counts)
    return HeadStep(new["a"], new["b"], ga, gb, seconds, counts, clipped)


def simulated_head_step(
    model: HEBert,
    ids: npt.ArrayLike,
    y: npt.ArrayLike,
    A: npt.ArrayLike,
    B: npt.ArrayLike,
    lr: float,
    mask: npt.ArrayLike | None = None,
    max_level: int = 10**6,
) -> HeadStep:
    """The step of the module docstring in float64 (the HE program, no encryption)."""
    owner = StepOwner.float64(model, ids, mask, max_level)
    return _step(model, ids, mask, y, A, B, lr, owner)


def encrypted_head_step(
    model: HEBert,
    ids: npt.ArrayLike,
    y: npt.ArrayLike,
    A: npt.ArrayLike,
    B: npt.ArrayLike,
    lr: float,
    params: CKKSParams,
    mask: npt.ArrayLike | None = None,
    bounds: UpdateBounds = DEFAULT_BOUNDS,
) -> HeadStep:
    """The step under CKKS (TenSEAL, Galois keys for the slot sums).

    The updated adapter is bounded (``bounds``, :mod:`crypto.program.bounds`) against
    the one before the step; the range guard on the ids is advisory (logged).
    """
    return _step(model, ids, mask, y, A, B, lr, StepOwner.ckks(model, params), bounds)


def reference_head_step(
    model: HEBert,
    ids: npt.ArrayLike,
    y: npt.ArrayLike,
    A: npt.ArrayLike,
    B: npt.ArrayLike,
    lr: float,
    mask: npt.ArrayLike | None = None,
) -> HeadStep:
    """The same step by ``torch`` autograd on the plaintext polynomial model."""
    import torch

    labels, a, b, lr = _check(model, y, A, B, lr)
    ids_t, mask_t = model.check_ids(ids, mask)
    start = time.perf_counter()
    seen: list[torch.Tensor] = []
    hook = model.classifier.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].detach())
    )
    try:
        with torch.no_grad():
            model(ids_t, mask_t, poly=True)
    finally:
        hook.remove()
    pooled = seen[0]
    at = torch.tensor(a, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    weight = model.classifier.weight.detach().T
    logits = pooled @ (weight + at @ bt) + model.classifier.bias.detach()
    target = torch.nn.functional.one_hot(
        torch.as_tensor(labels), model.config.n_classes
    ).to(torch.float64)
    loss = 0.5 * ((logits - target) ** 2).sum(1).mean()
    loss.backward()  # type: ignore[no-untyped-call]
    assert at.grad is not None
    assert bt.grad is not None
    ga, gb = at.grad.numpy(), bt.grad.numpy()
    seconds = time.perf_counter() - start
    return HeadStep(a - lr * ga, b - lr * gb, ga, gb, seconds, {})
