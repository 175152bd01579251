"""The reply-time side channel (issue 37): what a server reads from a round's time.

A server times every reply. Before the constant-work steps, a round's time grew
with the records each step sampled, hence with the private record count ``n``:

* **numpy backend** (:func:`numpy_timing`): the softmax model, the sampling rate
  alternated between 0.02 and 0.5 (the sample varies, the records do not);
* **Opacus backend** (:func:`opacus_timing`): ``make_private`` on a node whose
  private record count alternates between 60 and 600 under one public count 600
  and one rate (every value the server sees is the same); the old path (Opacus's
  ``DPDataLoader``, variable-size Poisson batches, as ``make_private`` did before)
  and the padded one are timed alternately in one run;
* **instrumented rows** (:func:`opacus_rows`): the rows whose per-sample gradients
  each step computed, which the fast tests compare exactly.

``python -m tests.federated.redteam`` prints these rows with the other attacks'.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from defense_suite.federated.client import LocalData, StepPlan, batches, local_train

Q, STEPS, PUBLIC = 0.05, 4, 600
"""The Opacus timing round: rate, steps and the node's public count."""


def numpy_timing(
    data: LocalData, trials: int = 200, seed: int = 0
) -> tuple[float, float, float]:
    """Correlation of reply time and sampled records; median times (few, many)."""
    times, sampled = [], []
    weights = [np.zeros((data.X.shape[1], data.n_classes)), np.zeros(data.n_classes)]
    for trial in range(trials):
        q = 0.02 if trial % 2 else 0.5
        plan = StepPlan(q, 4, 1.0)
        draw = batches(np.random.default_rng([seed, trial]), len(data), q, 4, "poisson")
        start = time.perf_counter()
        local_train(
            weights, data, plan, lr=0.5, clip=1.0,
            rng=np.random.default_rng([seed, trial]), public_count=500,
        )  # fmt: skip
        times.append(time.perf_counter() - start)
        sampled.append(sum(b.size for b in draw))
    return summary(times, sampled)


def summary(times: list[float], sampled: list[int]) -> tuple[float, float, float]:
    """Correlation of time and sampled records, median times below/above the median."""
    t, s = np.asarray(times), np.asarray(sampled)
    few, many = np.median(t[s < np.median(s)]), np.median(t[s >= np.median(s)])
    return float(np.corrcoef(t, s)[0, 1]), float(few), float(many)


def records(n: int, seed: int = 0, d: int = 100) -> Any:
    """A node's ``n`` private records as a torch data set (float64, 3 classes)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(X, torch.randint(0, 3, (n,), generator=g))


def opacus_round(
    dataset: Any,
    rng: np.random.Generator,
    padded: bool = True,
    public: int = PUBLIC,
    rate: float = Q,
    steps: int = STEPS,
) -> Any:
    """One user round on the Opacus path (make_private, ``rnd.batches``); returns
    the optimizer (its ``rows`` and ``sampled`` per step) and the trained net.

    ``padded=False`` replays ``make_private`` as it was before the constant-work
    steps: Opacus's ``DPDataLoader`` (variable-size Poisson batches) on the same
    generator stream, the same optimizer without masks.
    """
    import torch
    from opacus import GradSampleModule
    from opacus.data_loader import DPDataLoader

    from defense_suite.federated.flower.client import PrivateRound
    from defense_suite.federated.ledger import ClientPrivacy, Grant, PrivacyLedger
    from defense_suite.federated.private_optimizer import SanitizingDPOptimizer

    torch.set_num_threads(1)
    privacy = ClientPrivacy(epsilon=50.0, delta=1e-5, rounds=1, steps=steps, sigma=1.0)
    rnd = PrivateRound(
        Grant(1, rate, 1.0, steps), PrivacyLedger(privacy), rng, 0, public
    )
    torch.manual_seed(0)
    d = dataset[0][0].shape[0]
    net = torch.nn.Sequential(
        torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
    ).double()
    sgd = torch.optim.SGD(net.parameters(), lr=0.5)
    if padded:
        model, optimizer, loader = rnd.make_private(
            net, sgd, dataset, max_grad_norm=1.0
        )
    else:
        generator = torch.Generator().manual_seed(int(rng.integers(2**63 - 1)))
        loader = DPDataLoader(dataset, sample_rate=rate, generator=generator)
        model = GradSampleModule(net, loss_reduction="mean")
        optimizer = SanitizingDPOptimizer(
            sgd, noise_multiplier=1.0, max_grad_norm=1.0,
            expected_batch_size=max(1, round(rate * public)),
            loss_reduction="mean", generator=generator,
        )  # fmt: skip
        optimizer.attach_step_hook(rnd._count)
    for xb, yb in rnd.batches(loader):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    assert rnd.taken == steps
    return optimizer, net


def opacus_rows(sizes: tuple[int, ...], seed: int = 0) -> dict[int, tuple[list, list]]:
    """Per private record count: rows computed and records sampled, each step."""
    out = {}
    for n in sizes:
        optimizer, _ = opacus_round(records(n, seed), np.random.default_rng([seed, n]))
        out[n] = (list(optimizer.rows), list(optimizer.sampled))
    return out


def opacus_timing(
    trials: int = 200, seed: int = 0, small: int = 60, large: int = 600
) -> dict[str, tuple[float, float, float]]:
    """Reply time against sampled records, old path and padded path side by side.

    Trial ``t`` runs a node of ``small`` records (odd ``t``) or ``large`` (even),
    public count :data:`PUBLIC` for both, on both paths one after the other (the
    order alternates), so load drifts hit both alike. Returns per path the
    correlation of round time with the records sampled, and the median times of
    the rounds that sampled few and many.
    """
    import warnings

    data = {n: records(n, seed) for n in (small, large)}
    times: dict[str, list[float]] = {"old": [], "padded": []}
    sampled: dict[str, list[int]] = {"old": [], "padded": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for trial in range(trials):
            n = small if trial % 2 else large
            order = ("old", "padded") if (trial // 2) % 2 else ("padded", "old")
            for path in order:
                rng = np.random.default_rng([seed, trial])
                start = time.perf_counter()
                optimizer, _ = opacus_round(data[n], rng, padded=path == "padded")
                times[path].append(time.perf_counter() - start)
                sampled[path].append(sum(optimizer.sampled))
    return {path: summary(times[path], sampled[path]) for path in times}


def mlp_cost(data: LocalData, trials: int = 40, seed: int = 0) -> tuple[float, float]:
    """Median seconds per ``local_train`` call (MLP, Opacus), padded vs sampled rows.

    Alternated in one run (same rounds, same generator draws).
    """
    import warnings

    rng = np.random.default_rng(seed)
    d, k, h = data.X.shape[1], data.n_classes, 16
    params = [rng.normal(0, 0.1, (d, h)), np.zeros(h), rng.normal(0, 0.1, (h, k)),
              np.zeros(k)]  # fmt: skip
    plan = StepPlan(0.1, 4, 1.0)
    times: dict[bool, list[float]] = {True: [], False: []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for trial in range(trials):
            for constant in (True, False) if trial % 2 else (False, True):
                start = time.perf_counter()
                local_train(
                    params, data, plan, lr=0.5, clip=1.0,
                    rng=np.random.default_rng([seed, trial]),
                    public_count=len(data), constant_work=constant,
                )  # fmt: skip
                times[constant].append(time.perf_counter() - start)
    return float(np.median(times[True])), float(np.median(times[False]))
