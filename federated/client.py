r"""Local DP-SGD on one client: Poisson sampling, per-example clipping, Gaussian noise.

One step at sampling rate :math:`q`, noise multiplier :math:`\sigma`, clip norm
:math:`C` on a client holding :math:`n` records whose public count is :math:`N`
(Abadi et al., 2016):

.. math::

    B \sim \text{Poisson}(q)\ \text{over}\ [n], \quad
    \bar g = \frac{1}{qN}\Big(\sum_{i\in B} \tilde g_i \min(1, C/\lVert \tilde g_i
             \rVert) + \mathcal N(0, \sigma^2 C^2 I)\Big), \quad
    w \leftarrow w - \eta \bar g ,

where :math:`\tilde g_i` is :math:`g_i` if finite, else 0 (:mod:`federated.release`,
the one release path: sanitize, clip, noise, check, normalize). Dividing by the
*expected* batch size :math:`qN` of a *public* count keeps the release a function
of the clipped sum alone, which is what the subsampled-Gaussian accountant assumes,
and keeps the private size out of the noise scale. Two
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
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_int, check_real
from defenses.data import check_labelled

from .release import expected_batch, finite_release, noised_sum
from .softmax import Lane, label_table, softmax_, train_softmax

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
    """The ``steps`` batches of one round under ``sampling``.

    Poisson batches come from one draw of ``steps`` x ``n`` uniforms: the same
    stream, hence the same batches, as ``steps`` calls of :func:`poisson_batch`.
    """
    if sampling == "poisson":
        draws = rng.random((steps, n)) < q
        return [row.nonzero()[0].astype(np.int64, copy=False) for row in draws]
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
    """Gaussian mechanism on a clipped sum, divided by the public expected batch.

    The noised sum is finite for every input (:func:`federated.release.noised_sum`);
    ``expected_batch`` is :math:`q N` for a public count :math:`N`.
    """
    return noised_sum(clipped_sum, sigma, clip, rng) / expected_batch


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


@dataclass(frozen=True)
class _Round:
    """One round's local training, as :func:`local_train` checked it.

    The plan, the step size, the clip norm, the round's random stream, the sampling,
    the public record count and whether a step's work is constant.
    """

    plan: StepPlan
    lr: float
    clip: float
    rng: np.random.Generator
    sampling: Sampling
    public_count: int
    constant_work: bool

    def batches(self, n: int) -> list[IntArray]:
        """The round's ``plan.steps`` batches over ``n`` records."""
        return batches(self.rng, n, self.plan.rate, self.plan.steps, self.sampling)

    @property
    def expected_batch(self) -> float:
        """The public normalizer :math:`qN` of a DP step."""
        return expected_batch(self.plan.rate, self.public_count)


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


def _proba(z: FloatArray) -> FloatArray:
    """Softmax of fresh logits, computed in place in their float type, as float64."""
    z = z if z.dtype.kind == "f" else z.astype(np.float64)
    return np.asarray(softmax_(z), dtype=np.float64)


def predict_proba(params: Sequence[FloatArray], X: FloatArray) -> FloatArray:
    """Class probabilities of softmax regression (2 arrays) or the ReLU MLP (4)."""
    if len(params) == 2:
        return _proba(X @ params[0] + params[1])
    hidden = np.maximum(X @ params[0] + params[1], 0.0)
    return _proba(hidden @ params[2] + params[3])


def _lane(data: LocalData, job: _Round) -> Lane:
    """The numpy backend's view of one client's round (batches drawn here)."""
    X = data.X if job.constant_work else np.ascontiguousarray(data.X)
    table = label_table(data.y, data.n_classes, X if job.plan.sigma else None)
    draws = job.batches(len(data))
    sigma, eb = job.plan.sigma, job.expected_batch
    return Lane(data.X, table, draws, job.lr, sigma, job.rng, eb)


def _train_softmax(params: Params, data: LocalData, job: _Round) -> Params:
    lane = _lane(data, job)
    return train_softmax(
        params, [lane], clip=job.clip, constant_work=job.constant_work
    )[0]


def _train_mlp(params: Params, data: LocalData, job: _Round) -> Params:
    import torch
    from opacus import GradSampleModule

    from .padding import RowMasks, padded, padded_rows
    from .private_optimizer import SanitizingDPOptimizer

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
        n, plan, lr = len(data), job.plan, job.lr
        loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
        if plan.sigma is None:
            sgd = torch.optim.SGD(net.parameters(), lr=lr)
            for index in job.batches(n):
                if index.size == 0:
                    continue
                sgd.zero_grad()
                (loss_fn(net(X[index]), y[index]) / index.size).backward()
                sgd.step()
        else:
            generator = torch.Generator().manual_seed(int(job.rng.integers(2**63 - 1)))
            model = GradSampleModule(net, loss_reduction="sum")
            # Opacus returns the noisy clipped *sum*; lr / (q N) divides it by the
            # public expected batch size, as in the numpy backend.
            scale = job.expected_batch
            # constant work: every step computes the public padded_rows(q, N) rows,
            # the sample first, the padding's gradients masked to zero before
            # clipping (federated.padding): the same clipped sum.
            masks = RowMasks() if job.constant_work else None
            rows = padded_rows(plan.rate, job.public_count)
            optimizer = SanitizingDPOptimizer(
                torch.optim.SGD(model.parameters(), lr=lr / scale),
                noise_multiplier=plan.sigma,
                max_grad_norm=job.clip,
                expected_batch_size=max(1, round(scale)),
                loss_reduction="sum",
                generator=generator,
                masks=masks,
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                for index in job.batches(n):
                    if masks is not None:
                        rows_index, mask = padded(index.tolist(), rows, n)
                        masks.push(mask)
                        index = np.asarray(rows_index, dtype=np.int64)
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


def _check_shapes(current: Params, data: LocalData) -> None:
    """Refuse weights whose shapes do not fit the public (d, classes) of ``data``.

    Checked before any record is touched: a label beyond the server's output
    width must not turn into an error that only sampled records trigger.
    """
    d, k = int(data.X.shape[1]), int(data.n_classes)
    shapes = [p.shape for p in current]
    ok = len(shapes) == 2 and shapes == [(d, k), (k,)]
    if len(shapes) == 4:
        h = shapes[0][1] if len(shapes[0]) == 2 else -1
        ok = shapes == [(d, h), (h,), (h, k), (k,)]
    if not ok:
        raise ValueError(
            f"params must be softmax [(d, k), (k,)] or MLP [(d, h), (h,), (h, k), "
            f"(k,)] arrays for d={d} features and k={k} classes, got {shapes}"
        )


def local_train(
    params: Sequence[FloatArray],
    data: LocalData,
    plan: StepPlan,
    *,
    lr: float,
    clip: float,
    rng: np.random.Generator,
    sampling: Sampling = "poisson",
    public_count: int | None = None,
    constant_work: bool = True,
) -> Params:
    """Run one round of local (DP-)SGD from ``params``; return the new weights.

    The model is told apart by the number of arrays: 2 is softmax regression (numpy
    backend), 4 is the one-hidden-layer ReLU MLP (torch + Opacus backend).

    A DP round (``plan.sigma`` set) is one release path for every input
    (:mod:`federated.release`): non-finite per-example gradients contribute zero
    before clipping, the noised sums are finite, the normalizer is
    ``plan.rate * public_count`` and the returned weights are finite
    (post-processing), so it never raises because of the records or of the
    weights' values. ``public_count`` is the client's public record count
    (default ``len(data)``: only for research loops where the size is public).
    ``constant_work`` (default) makes a step's work independent of the sample and
    of the private record count: the numpy backend computes every record's
    gradient and keeps the sample by a mask; the Opacus backend computes the
    public number of rows :func:`federated.padding.padded_rows` ``(q, N)``, the
    sample padded with rows whose gradients are masked to zero before clipping
    (same release, same epsilon). In-process research loops without a timing
    observer may turn it off (faster at small rates). Shapes are checked first
    (they are public).
    """
    count = len(data) if public_count is None else public_count
    job = _Round(plan, lr, clip, rng, sampling, count, constant_work)
    current, job = _checked(params, data, job)
    train = _train_softmax if len(current) == 2 else _train_mlp
    return _finish(train(current, data, job), job)


def _checked(
    params: Sequence[FloatArray], data: LocalData, job: _Round
) -> tuple[Params, _Round]:
    """:func:`local_train`'s checks; the weights as float arrays, the job checked.

    The job's step size and clip norm come back as floats (a Python integer such as
    2**64 would make numpy's in-place products object arrays).
    """
    if job.sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {job.sampling!r}")
    job = replace(
        job,
        lr=check_real("lr", job.lr, 0.0, open_low=True),
        clip=check_real("clip", job.clip, 0.0, open_low=True),
    )
    check_int("public_count", job.public_count, 1)
    current = [np.asarray(p, dtype=np.float64) for p in params]
    if len(current) not in (2, 4):
        raise ValueError(
            f"params must hold 2 (softmax) or 4 (MLP) arrays, got {len(current)}"
        )
    _check_shapes(current, data)
    return current, job


def _finish(new: Params, job: _Round) -> Params:
    """A DP round's weights made finite; a diverged non-private round refused."""
    if job.plan.sigma is not None:
        return finite_release(new)
    if not all(np.isfinite(p).all() for p in new):
        raise ValueError(
            f"local training diverged (non-finite weights) with lr={job.lr}, "
            f"clip={job.clip}, rate={job.plan.rate} (non-private training); lower "
            "lr, or rescale the features X"
        )
    return new


def local_train_clients(
    params: Sequence[FloatArray],
    clients: Sequence[LocalData],
    plans: Sequence[StepPlan],
    *,
    lrs: Sequence[float],
    clip: float,
    rngs: Sequence[np.random.Generator],
    sampling: Sampling = "poisson",
) -> list[Params]:
    """:func:`local_train` of every client from the same ``params`` (a FedAvg round).

    Each client's result is its :func:`local_train` with ``constant_work=False``
    and its own size as public count (an in-process research loop), bit for bit;
    softmax clients run in lockstep (:func:`federated.softmax.train_softmax`).
    """
    if not clients:
        return []
    jobs = [
        _Round(plan, lr, clip, rng, sampling, len(data), False)
        for data, plan, lr, rng in zip(clients, plans, lrs, rngs, strict=True)
    ]
    checked = [_checked(params, d, j) for d, j in zip(clients, jobs, strict=True)]
    current, jobs = checked[0][0], [job for _, job in checked]
    if len(current) == 4:
        trained = [
            _train_mlp(current, d, j) for d, j in zip(clients, jobs, strict=True)
        ]
    else:
        lanes = [_lane(d, j) for d, j in zip(clients, jobs, strict=True)]
        trained = train_softmax(current, lanes, clip=jobs[0].clip, constant_work=False)
    return [_finish(w, j) for w, j in zip(trained, jobs, strict=True)]
