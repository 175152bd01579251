r"""Local DP-SGD on one client: Poisson sampling, per-example clipping, Gaussian noise.

One step at sampling rate :math:`q`, noise multiplier :math:`\sigma`, clip norm
:math:`C` on a client holding :math:`n` records (Abadi et al., 2016):

.. math::

    B \sim \text{Poisson}(q)\ \text{over}\ [n], \quad
    \bar g = \frac{1}{qn}\Big(\sum_{i\in B} g_i \min(1, C/\lVert g_i\rVert)
             + \mathcal N(0, \sigma^2 C^2 I)\Big), \quad
    w \leftarrow w - \eta \bar g .

Dividing by the *expected* batch size :math:`qn` keeps the release a function of the
clipped sum alone, which is what the subsampled-Gaussian accountant assumes. Two
backends: numpy for multinomial logistic regression (exact per-example gradients
:math:`\tilde x \otimes (p - e_y)`) and torch + Opacus (``GradSampleModule`` and
``DPOptimizer``) for an MLP. ``sampling="fixed"`` replaces Poisson sampling by
fixed-size batches cut in order: an implementation error the audit must catch, never
a default.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_int, check_real
from defenses.data import check_labelled

Params = list[FloatArray]
Sampling = Literal["poisson", "fixed"]
SAMPLINGS: tuple[Sampling, ...] = ("poisson", "fixed")
Model = Literal["softmax", "mlp"]
MODELS: tuple[Model, ...] = ("softmax", "mlp")


def poisson_batch(rng: np.random.Generator, n: int, q: float) -> IntArray:
    """Indices of a Poisson sample: each of ``n`` records kept with probability q."""
    return np.flatnonzero(rng.random(n) < q).astype(np.int64)


def fixed_batches(n: int, q: float, steps: int) -> list[IntArray]:
    """Fixed-size batches of ``max(1, round(q n))`` records cut in order, cycling.

    This is what a data loader without Poisson sampling or shuffling yields; every
    record's participation is deterministic, so accounting it as Poisson sampling
    at rate q is wrong (the audit's negative control).
    """
    size = max(1, round(q * n))
    return [
        (np.arange(s * size, (s + 1) * size) % n).astype(np.int64) for s in range(steps)
    ]


def batches(
    rng: np.random.Generator, n: int, q: float, steps: int, sampling: Sampling
) -> list[IntArray]:
    """The ``steps`` batches of one round under ``sampling``."""
    if sampling == "poisson":
        return [poisson_batch(rng, n, q) for _ in range(steps)]
    return fixed_batches(n, q, steps)


def record_inclusion(
    rng: np.random.Generator,
    trials: int,
    n: int,
    q: float,
    steps: int,
    sampling: Sampling,
) -> npt.NDArray[np.bool_]:
    """Whether record 0 is in each step's batch, for ``trials`` independent rounds.

    Same law as ``0 in batches(rng, n, q, steps, sampling)[s]``, drawn in bulk:
    Poisson inclusion is an independent Bernoulli(q) per step; fixed batches are
    deterministic.
    """
    if sampling == "poisson":
        return rng.random((trials, steps)) < q
    fixed = np.array([bool(np.any(b == 0)) for b in fixed_batches(n, q, steps)])
    return np.broadcast_to(fixed, (trials, steps)).copy()


def privatize(
    clipped_sum: FloatArray,
    sigma: float,
    clip: float,
    expected_batch: float,
    rng: np.random.Generator,
) -> FloatArray:
    """Gaussian mechanism on a clipped gradient sum, divided by the expected batch."""
    noise = rng.normal(0.0, sigma * clip, size=clipped_sum.shape)
    return np.asarray((clipped_sum + noise) / expected_batch, dtype=np.float64)


@dataclass(frozen=True)
class LocalData:
    """A client's records: features (n, d) and labels (n,) in [0, n_classes)."""

    X: FloatArray
    y: IntArray
    n_classes: int

    def __post_init__(self) -> None:
        check_labelled("LocalData", self.X, self.y, self.n_classes)

    def __len__(self) -> int:
        return int(self.X.shape[0])


@dataclass(frozen=True)
class StepPlan:
    """One round's local training: ``steps`` steps at sampling rate ``rate``.

    ``sigma=None`` is non-private training (no clipping, no noise, batch mean).
    """

    rate: float
    steps: int
    sigma: float | None

    def __post_init__(self) -> None:
        check_real("rate", self.rate, 0.0, 1.0, open_low=True)
        check_int("steps", self.steps, 1)
        if self.sigma is not None:
            check_real("sigma", self.sigma, 0.0, open_low=True)


def init_params(
    model: Model, dim: int, n_classes: int, hidden: int, rng: np.random.Generator
) -> Params:
    """Initial weights: zeros for softmax regression, scaled Gaussian for the MLP."""
    if model == "softmax":
        return [np.zeros((dim, n_classes)), np.zeros(n_classes)]
    return [
        rng.normal(0.0, 1.0 / math.sqrt(dim), (dim, hidden)),
        np.zeros(hidden),
        rng.normal(0.0, 1.0 / math.sqrt(hidden), (hidden, n_classes)),
        np.zeros(n_classes),
    ]


def _softmax(z: FloatArray) -> FloatArray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return np.asarray(e / e.sum(axis=1, keepdims=True), dtype=np.float64)


def predict_proba(params: Sequence[FloatArray], X: FloatArray) -> FloatArray:
    """Class probabilities of softmax regression (2 arrays) or the ReLU MLP (4)."""
    if len(params) == 2:
        return _softmax(X @ params[0] + params[1])
    hidden = np.maximum(X @ params[0] + params[1], 0.0)
    return _softmax(hidden @ params[2] + params[3])


def _softmax_step(
    W: FloatArray,
    b: FloatArray,
    X: FloatArray,
    y: IntArray,
    clip: float | None,
) -> tuple[FloatArray, FloatArray]:
    r"""Summed (clipped) per-example gradients of the cross-entropy.

    The per-example gradient is the rank-one pair :math:`(x_i r_i^T, r_i)` with
    residual :math:`r_i = p_i - e_{y_i}`, so its norm is
    :math:`\lVert r_i\rVert \sqrt{\lVert x_i\rVert^2 + 1}` and the clipped sum
    is :math:`X^T (s \odot R)` without materialising per-example gradients.
    """
    residual = _softmax(X @ W + b)
    residual[np.arange(y.size), y] -= 1.0
    if clip is not None:
        norms = np.linalg.norm(residual, axis=1) * np.sqrt((X * X).sum(axis=1) + 1.0)
        residual *= np.minimum(1.0, clip / np.maximum(norms, 1e-300))[:, None]
    return X.T @ residual, residual.sum(axis=0)


def _train_softmax(
    params: Params,
    data: LocalData,
    plan: StepPlan,
    lr: float,
    clip: float,
    rng: np.random.Generator,
    sampling: Sampling,
) -> Params:
    W, b = params[0].copy(), params[1].copy()
    n = len(data)
    for index in batches(rng, n, plan.rate, plan.steps, sampling):
        X, y = data.X[index], data.y[index]
        if plan.sigma is None:
            if index.size == 0:
                continue
            gW, gb = _softmax_step(W, b, X, y, None)
            W -= lr * gW / index.size
            b -= lr * gb / index.size
            continue
        gW, gb = _softmax_step(W, b, X, y, clip)
        flat = privatize(
            np.concatenate([gW.ravel(), gb]), plan.sigma, clip, plan.rate * n, rng
        )
        W -= lr * flat[: W.size].reshape(W.shape)
        b -= lr * flat[W.size :]
    return [W, b]


def _train_mlp(
    params: Params,
    data: LocalData,
    plan: StepPlan,
    lr: float,
    clip: float,
    rng: np.random.Generator,
    sampling: Sampling,
) -> Params:
    import torch
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = torch.nn.Linear(*params[0].shape).double()
        second = torch.nn.Linear(*params[2].shape).double()
        net = torch.nn.Sequential(first, torch.nn.ReLU(), second)
        with torch.no_grad():
            for layer, (w, bias) in zip(
                (first, second),
                ((params[0], params[1]), (params[2], params[3])),
                strict=True,
            ):
                layer.weight.copy_(torch.from_numpy(w.T.copy()))
                layer.bias.copy_(torch.from_numpy(bias.copy()))
        X = torch.from_numpy(data.X)
        y = torch.from_numpy(data.y)
        n = len(data)
        loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
        if plan.sigma is None:
            sgd = torch.optim.SGD(net.parameters(), lr=lr)
            for index in batches(rng, n, plan.rate, plan.steps, sampling):
                if index.size == 0:
                    continue
                sgd.zero_grad()
                (loss_fn(net(X[index]), y[index]) / index.size).backward()
                sgd.step()
        else:
            generator = torch.Generator().manual_seed(int(rng.integers(2**63 - 1)))
            model = GradSampleModule(net, loss_reduction="sum")
            # Opacus returns the noisy clipped *sum*; lr / (q n) divides it by the
            # expected batch size, as in the numpy backend.
            optimizer = DPOptimizer(
                torch.optim.SGD(model.parameters(), lr=lr / (plan.rate * n)),
                noise_multiplier=plan.sigma,
                max_grad_norm=clip,
                expected_batch_size=max(1, round(plan.rate * n)),
                loss_reduction="sum",
                generator=generator,
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                for index in batches(rng, n, plan.rate, plan.steps, sampling):
                    optimizer.zero_grad(set_to_none=True)
                    loss_fn(model(X[index]), y[index]).backward()
                    optimizer.step()
        out = [
            first.weight.detach().numpy().T.copy(),
            first.bias.detach().numpy().copy(),
            second.weight.detach().numpy().T.copy(),
            second.bias.detach().numpy().copy(),
        ]
    finally:
        torch.set_num_threads(threads)
    return [np.asarray(a, dtype=np.float64) for a in out]


def local_train(
    params: Sequence[FloatArray],
    data: LocalData,
    plan: StepPlan,
    *,
    lr: float,
    clip: float,
    rng: np.random.Generator,
    sampling: Sampling = "poisson",
) -> Params:
    """Run one round of local (DP-)SGD from ``params``; return the new weights.

    The model is told apart by the number of arrays: 2 is softmax regression (numpy
    backend), 4 is the one-hidden-layer ReLU MLP (torch + Opacus backend).
    """
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    check_real("lr", lr, 0.0, open_low=True)
    check_real("clip", clip, 0.0, open_low=True)
    current = [np.asarray(p, dtype=np.float64) for p in params]
    if current and (current[0].ndim != 2 or current[0].shape[0] != data.X.shape[1]):
        raise ValueError(
            f"LocalData.X has {data.X.shape[1]} features but params[0] has shape "
            f"{current[0].shape}"
        )
    if len(current) == 2:
        new = _train_softmax(current, data, plan, lr, clip, rng, sampling)
    elif len(current) == 4:
        new = _train_mlp(current, data, plan, lr, clip, rng, sampling)
    else:
        raise ValueError(
            f"params must hold 2 (softmax) or 4 (MLP) arrays, got {len(current)}"
        )
    if not all(np.isfinite(p).all() for p in new):
        raise ValueError(
            f"local training diverged (non-finite weights) with lr={lr}, "
            f"clip={clip}, sigma={plan.sigma}, rate={plan.rate}; lower lr or sigma, "
            "or rescale the features X"
        )
    return new
