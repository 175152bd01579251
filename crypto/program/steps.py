r"""The HEFormer layer's fine-tuning steps by function calls, and their reference.

One SGD step on a batch of ``B`` client sequences (Rho et al., 2025, Sec. 4.2, with
SGD instead of AdamW-HE and the squared error on the logits instead of the
polynomial cross-entropy):

1. the client encrypts its embedded batch (feature-major), the one-hot labels on the
   CLS slots and the trained weights (one replicated ciphertext per entry);
2. the server runs :func:`crypto.program.backward.train_forward` and
   :func:`crypto.program.backward.backward` under CKKS with its public context (Galois
   keys for the slot sums) and applies :math:`W \leftarrow W - \eta\, c^2 \odot \bar W`
   itself, :math:`c` being the public factor folded into each matrix (:math:`\kappa`
   into Q and K, :math:`1/B_p` into the pooler, the LayerNorm gain into :math:`W_1`), so
   the step is the model's own SGD step;
3. the client only serves round trips: refreshes (decrypt and re-encrypt, the
   stand-in for bootstrapping, counted), the rolled copies of K and V, the
   rolled-back key and value gradients, and the refresh of the updated weights
   before the next step.

Two arms: ``lora`` trains the LoRA factors of Q, K and V and the head (pooler and
classifier), all encrypted, with every other weight plaintext on the server;
``full`` trains every weight matrix (Q, K, V, output, both feed-forward matrices,
the head), all encrypted. Either runs with Gaussian-kernel or polynomial-softmax
attention. :func:`simulated_step` is the packed computation in float64 (the
server's :func:`~crypto.program.sgd.sgd_steps`, the key owner's round trips as
calls); :func:`reference_step` is the same step by torch autograd on the polynomial
model (the HE simulation). The step under CKKS, as messages with a public-context
server, is :func:`crypto.protocol.finetune.encrypted_step`: it reuses the client's
side here (the batch's checks, the fold and the unfold).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from defenses.arrays import FloatArray
from defenses.checks import check_int, check_real

from ..he.ckks import CKKSParams
from ..he.evaluator import Backend, Evaluator, NumpyBackend
from ..he.packing import pack
from ..models.heformer import HEFormer
from ..models.train import predict_logits
from ..tasks import check_labels, check_sequences
from .backward import Trained, train_forward
from .bounds import DEFAULT_BOUNDS, UpdateBounds
from .folding import LORA_GK, Arm, effective_weights, plain_net
from .forward import Run
from .net import Net
from .owner import Calls
from .sgd import cls_mask, sgd_reply
from .shadow import flag_sequences, report

TRAIN_PARAMS = CKKSParams(8192, (49, 40, 40, 40, 49), 40)
"""N = 8192, 3 levels of 40 bits (218 bits), 49-bit special prime (precise sums)."""


@dataclass
class StepResult:
    """Updated weights (model parametrisation), operation counts and seconds.

    ``seconds`` is the step's wall time, ``cpu_seconds`` the CPU time this process
    spent on it (all threads), which a loaded machine inflates far less, and
    ``system_seconds`` the kernel's part of it (page faults and memory mapping,
    which grow with the process's footprint).
    """

    weights: dict[str, FloatArray]
    counts: dict[str, int]
    seconds: float
    cpu_seconds: float = 0.0
    system_seconds: float = 0.0
    clipped: int = 0
    """Entries the public update bounds changed (encrypted step; 0 if honest)."""
    bounds: UpdateBounds = DEFAULT_BOUNDS
    """The agreed update bounds (``apply_weights(model, weights, bounds)``)."""


def _check_batch(
    model: HEFormer, X: npt.ArrayLike, y: npt.ArrayLike, guard: bool = True
) -> tuple[FloatArray, npt.NDArray[np.int64]]:
    c = model.config
    arr = check_sequences(X, c.n_tokens, c.token_dim)
    labels = check_labels(y, arr.shape[0], c.n_classes)
    if guard:
        predict_logits(model, arr, guard=True)  # the polynomials' calibrated ranges
    else:  # advisory (logged): the weights may carry an earlier step's update
        report(flag_sequences(model, arr), "sequences of the step")
    slots = arr.shape[0] * c.n_tokens
    if slots & (slots - 1):
        raise ValueError(
            f"X: batch x tokens = {slots} must be a power of two (slot sums rotate "
            "within the packed vector)"
        )
    return arr, labels


def _check_step(lr: float, steps: int, arm: Arm) -> tuple[float, int]:
    lr = check_real("lr", lr, 0.0, open_low=True)
    steps = check_int("steps", steps, 1)
    if not isinstance(arm, Arm):
        raise TypeError(f"arm must be an Arm, got {type(arm).__name__}")
    return lr, steps


def _prepare(
    model: HEFormer, X: FloatArray, y: npt.ArrayLike, arm: Arm, guard: bool = True
) -> tuple[Net, dict[str, Any], list[FloatArray], FloatArray, int]:
    """The client's side: folded net, fold factors, packed batch, targets, batch."""
    X, labels = _check_batch(model, X, y, guard)
    c = model.config
    b, n = X.shape[0], c.n_tokens
    net, fold = plain_net(model, arm, X)
    with torch.no_grad():
        z = model.embed_tokens(torch.as_tensor(X, dtype=torch.float64)).numpy()
    onehot = np.zeros((c.n_classes, b * n))
    onehot[labels, np.arange(b) * n] = 1.0
    return net, fold, pack(z, b * n), onehot, b


def _unfold(
    folded: dict[str, FloatArray], fold: dict[str, Any], lr: float, strict: bool = True
) -> dict[str, FloatArray]:
    out = {}
    for name, W in folded.items():
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            out[name] = W / np.asarray(fold[name], dtype=float)
        if strict and not np.all(np.isfinite(out[name])):
            raise ValueError(
                f"lr = {lr!r} made the step diverge ({name} is not finite); "
                "use a smaller lr"
            )
    return out


def _run(
    model: HEFormer,
    X: FloatArray,
    y: npt.ArrayLike,
    lr: float,
    steps: int,
    arm: Arm,
    backend: Backend,
    owner: Calls,
    max_level: int,
) -> StepResult:
    """The step with the key owner's round trips as function calls.

    :func:`~crypto.program.sgd.sgd_reply` (the protocol server's step) on the
    client's encrypted upload; the key owner's work inside the timed step is
    counted.
    """
    lr, steps = _check_step(lr, steps, arm)
    net, fold, packed, onehot, b = _prepare(model, X, y, arm)
    ev = Evaluator(backend, max_level)
    calls = owner.counted(ev)
    ev.refresh = calls.refresh
    start, cpu = time.perf_counter(), time.process_time()
    inputs, targets = calls.values(packed), calls.values(onehot)
    secrets = {name: calls.matrix(np.asarray(net.mats[name])) for name in net.trained}
    shapes = [(name, len(M), len(M[0])) for name, M in secrets.items()]
    upload = (inputs, targets, secrets)
    mask = cls_mask(b, net.n_tokens)
    trips = (calls.refresh, calls.roll, calls.unroll)
    reply = iter(sgd_reply(ev, net, fold, upload, mask, lr, steps, trips))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    folded = {
        name: calls.read([[next(reply) for _ in range(c)] for _ in range(r)])
        for name, r, c in shapes
    }
    return StepResult(_unfold(folded, fold, lr), dict(ev.counts), seconds, cpu)


def simulated_step(
    model: HEFormer,
    X: FloatArray,
    y: npt.ArrayLike,
    lr: float,
    arm: Arm = LORA_GK,
    steps: int = 1,
    max_level: int = TRAIN_PARAMS.levels,
    noise: float = 0.0,
    rng: np.random.Generator | None = None,
) -> StepResult:
    """The packed step in float64 (optionally with CKKS-like noise)."""
    X, _ = _check_batch(model, X, y)
    backend = NumpyBackend(noise, rng)
    slots = X.shape[0] * model.config.n_tokens
    owner = Calls.plain(model.config.n_tokens, slots)
    return _run(model, X, y, lr, steps, arm, backend, owner, max_level)


def reference_step(
    model: HEFormer,
    X: FloatArray,
    y: npt.ArrayLike,
    lr: float,
    arm: Arm = LORA_GK,
    steps: int = 1,
) -> dict[str, FloatArray]:
    """The same SGD steps by torch autograd on the polynomial model (a copy).

    Only the Gaussian-kernel arms have a polynomial torch twin.
    """
    if arm.attention != "gk":
        raise ValueError("the torch reference exists for the Gaussian-kernel arms")
    lr = check_real("lr", lr, 0.0, open_low=True)
    steps = check_int("steps", steps, 1)
    X, labels = _check_batch(model, X, y)
    net = copy.deepcopy(model)
    params: list[torch.nn.Parameter]
    if arm.trained == "lora":
        params = net.lora_parameters() + net.head_parameters()
    else:
        params = [
            net.q.weight,
            net.k.weight,
            net.v.weight,
            net.out,
            net.w1,
            net.w2,
            *net.head_parameters(),
        ]
    Xt = torch.as_tensor(X, dtype=torch.float64)
    target = torch.nn.functional.one_hot(
        torch.as_tensor(labels), model.config.n_classes
    )
    for _ in range(steps):
        for p in net.parameters():
            p.grad = None
        logits = net(Xt, poly=True)
        loss = 0.5 * ((logits - target.to(torch.float64)) ** 2).sum(1).mean()
        loss.backward()
        with torch.no_grad():
            for p in params:
                assert p.grad is not None
                p.sub_(lr * p.grad)
    out = effective_weights(net, arm)
    if not all(np.all(np.isfinite(w)) for w in out.values()):
        raise ValueError(f"lr = {lr!r} made the step diverge; use a smaller lr")
    return out


def simulated_loss(
    model: HEFormer, X: FloatArray, y: npt.ArrayLike, arm: Arm = LORA_GK
) -> float:
    r"""Squared-error loss of the packed forward pass in float64.

    :math:`\tfrac1{2B}\sum_b\lVert\ell_b-y_b\rVert^2`, for either attention.
    """
    X, labels = _check_batch(model, X, y)
    n = model.config.n_tokens
    net, _ = plain_net(model, arm, X)
    with torch.no_grad():
        z = model.embed_tokens(torch.as_tensor(X, dtype=torch.float64)).numpy()
    calls = Calls.plain(n, X.shape[0] * n)
    ev = Evaluator(NumpyBackend(), 10**6)
    for name in net.trained:  # the trained matrices as the program reads them
        net.mats[name] = calls.matrix(np.asarray(net.mats[name]))
    run = Run(ev, net.secrets(), calls.roll)
    packed = calls.values(pack(z, calls.slots))
    logits = train_forward(run, net.program(), packed, Trained(1, net.softmax))
    cls = np.stack([np.asarray(v.handle)[::n] for v in logits], axis=1)
    target = np.eye(model.config.n_classes)[labels]
    return float(0.5 * np.mean(np.sum((cls - target) ** 2, axis=1)))
