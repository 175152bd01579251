"""The deletion benchmark: accuracy, deletions served and retraining cost.

For one ``(m, L)`` and each seed: pretrain the backbone on the public digits,
fit full retraining (the reference, variant ``"none"``), SISA, S3T with one order
(``s3t-b1``, what the paper's code calls SISA) and S3T with ``B`` cyclic orders
(plus BMS orders under a skewed stream); then replay deletion streams against copies
of each fitted model, one deletion at a time, without retraining:

* ``deletions_served``: deletions until every shard is dead (the deletion that
  kills the last shard counts, as in the theory ``m L H_{m B'}``, reported for
  uniform streams; ``deletions_simulated`` is the slice-level Monte Carlo under the
  stream's prior);
* accuracy every ``every`` deletions, over the streams still alive;
* retraining cost in sample-gradient passes under each method's policy: full
  retraining pays a whole fit per deletion; SISA retrains the hit shard from the
  checkpoint before the hit slice at every deletion; S3T and ``s3t-b1`` pay a whole
  fit each time every shard is dead (then start over on a fresh copy);
* wall time of deletions that need no retraining, against one shard's training time.

The model replays are few (each one copies a fitted model and measures accuracy), so
their mean number of deletions served scatters widely (one stream's count has a
standard deviation of about 10 at m = L = 3). The count itself needs no model: a
shard dies when every one of its orders has lost its first slice, so the system
dies at the first deletion by which every ``(shard, first slice)`` cell has been
hit. ``bookkeeping_streams`` streams over the same pool, partition and orders are
replayed that way (``deletions_served_many``, its standard error ``..._se``; the
same streams for every method, so ratios are paired), and a test checks the rule
against :meth:`Unlearner.delete`. ``deletions_theory_sizes`` is the theory for the
partition the hash actually drew (:func:`~defenses.s3t.sequences.expected_deletions`
with each cell's share of the stream's probability), and the ``..._over_sisa``
ratios put measured and theory side by side: ``m L H_{m B'} / m L H_m`` (1.54 at
m = L = B = 3) assumes equal slices, which a hash partition does not give.

Streams are uniform over the pool, or skewed: slice index ``j`` (of every shard) is
hit with a Zipf prior ``p_j ~ 1 / rank_j^a`` (ranks shuffled per seed) and a point
uniformly within the slice; BMS knows ``p``.
"""

from __future__ import annotations

import copy
import logging
import statistics
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_int, check_keys, check_real
from defenses.harness import measurement
from defenses.metrics import accuracy
from defenses.results import Result
from defenses.s3t.baselines import SISA, FullRetrain
from defenses.s3t.defense import S3T, Unlearner
from defenses.s3t.sequences import (
    deletion_rate_theory,
    expected_deletions,
    simulate_deletion_rate,
)
from defenses.s3t.tasks import ModelSettings, pretrained_backbone, split_digits
from defenses.s3t.training import single_thread

logger = logging.getLogger(__name__)


DEFAULTS: dict[str, Any] = {
    "shards": 3,
    "slices": 3,
    "sequences": 0,
    "streams": 5,
    "max_deletions": 60,
    "every": 5,
    "skew": "uniform",
    "zipf": 1.5,
    "pool": 0,
    "public": 300,
    "width": 64,
    "hidden": 128,
    "blocks": 6,
    "pretrain_epochs": 20,
    "rank": 8,
    "epochs": 10,
    "lr": 5e-3,
    "simulation_runs": 2000,
    "bookkeeping_streams": 2000,
}


@dataclass(frozen=True, kw_only=True)
class Settings(ModelSettings):
    """Validated benchmark parameters (see :data:`DEFAULTS`)."""

    shards: int
    slices: int
    sequences: int
    streams: int
    max_deletions: int
    every: int
    skew: str
    zipf: float
    pool: int
    simulation_runs: int
    bookkeeping_streams: int

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> Settings:
        """Fill defaults and check every value."""
        check_keys("s3t-deletion", params, DEFAULTS)
        values = {**DEFAULTS, **params}
        if values["sequences"] == 0:
            values["sequences"] = values["slices"]
        for name, value in values.items():
            if name in ("skew", "zipf", "lr", "pool"):
                continue
            check_int(f"s3t-deletion.{name}", value, minimum=1)
        if values["skew"] not in ("uniform", "zipf"):
            raise ValueError(
                f"s3t-deletion.skew must be 'uniform' or 'zipf', got {values['skew']!r}"
            )
        check_real("s3t-deletion.zipf", values["zipf"], 0.0, open_low=True)
        if not isinstance(values["pool"], int) or values["pool"] < 0:
            raise ValueError(
                f"s3t-deletion.pool must be an int >= 0, got {values['pool']!r}"
            )
        return cls(**values)


@dataclass
class Trace:
    """What one stream did to one model."""

    served: int
    accuracy: dict[int, float]
    cost: dict[int, float]
    delete_seconds: list[float]


def _stream(
    rng: np.random.Generator,
    ids: IntArray,
    cells: IntArray,
    prior: FloatArray | None,
    length: int,
) -> IntArray:
    if prior is None:
        return rng.permutation(ids)[:length]
    sizes = np.bincount(cells, minlength=prior.size)[cells]
    weights = prior[cells % prior.size] / sizes
    return rng.choice(
        ids, size=min(length, ids.size), replace=False, p=weights / weights.sum()
    )


def _weights(cells: IntArray, prior: FloatArray | None) -> FloatArray:
    """Each point's probability of being the next deletion (uniform or Zipf)."""
    if prior is None:
        return np.full(cells.size, 1.0 / cells.size)
    sizes = np.bincount(cells, minlength=prior.size)[cells]
    weights: FloatArray = prior[cells % prior.size] / sizes
    normalised: FloatArray = weights / weights.sum()
    return normalised


def stream_positions(
    rng: np.random.Generator, weights: FloatArray, runs: int
) -> IntArray:
    """``runs`` streams that delete every point once: each point's turn (1-based).

    Orders are drawn with probabilities ``weights`` without replacement
    (Efraimidis and Spirakis 2006: sort by ``-log(U) / w``); shape
    ``(runs, weights.size)``.
    """
    keys = -np.log(rng.random((runs, weights.size))) / weights
    position = np.empty((runs, weights.size), dtype=np.int64)
    turns = np.arange(1, weights.size + 1)[None]
    np.put_along_axis(position, np.argsort(keys, axis=1), turns, 1)
    return position


def first_hits(cells: IntArray, position: IntArray) -> IntArray:
    """The deletion (1-based) of each stream that first hits each cell."""
    runs, n = position.shape
    out = np.full((runs, int(cells.max()) + 1), n + 1, dtype=np.int64)
    for c in np.unique(cells):
        out[:, c] = position[:, cells == c].min(axis=1)
    return out


def needed_cells(model: Unlearner) -> list[int]:
    """The ``(shard, first slice)`` cells (as ``s L + j``) whose hits kill the model."""
    firsts = sorted({o[0] for o in model.orders})
    return [s * model.slices + j for s in range(model.shards) for j in firsts]


def _bookkeeping(
    methods: Mapping[str, tuple[Unlearner, str]],
    hits: IntArray,
    cell_probs: FloatArray,
) -> dict[str, dict[str, float]]:
    """Deletions served over many streams, theory for the drawn slice sizes, ratios."""
    out: dict[str, dict[str, float]] = {}
    counts: dict[str, FloatArray] = {}
    for variant, (model, _) in methods.items():
        if model.shards * model.slices == 1:
            continue
        needed = needed_cells(model)
        served = hits[:, needed].max(axis=1).astype(np.float64)
        counts[variant] = served
        out[variant] = {
            "deletions_served_many": float(served.mean()),
            "deletions_served_many_se": float(
                served.std(ddof=1) / np.sqrt(served.size)
            ),
            "deletions_theory_sizes": expected_deletions(cell_probs[needed]),
        }
    sisa = out.get("sisa")
    if sisa is not None:
        base = counts["sisa"]
        for variant, values in out.items():
            for key in ("deletions_served_many", "deletions_theory_sizes"):
                values[f"{key}_over_sisa"] = values[key] / sisa[key]
            # delta method on the paired streams: se of mean(a) / mean(b)
            ratio = values["deletions_served_many_over_sisa"]
            spread = (counts[variant] - ratio * base) / base.mean()
            values["deletions_served_many_over_sisa_se"] = float(
                spread.std(ddof=1) / np.sqrt(spread.size)
            )
    return out


def _hit_cost(model: Unlearner, shard: int, slc: int) -> float:
    stages = model.stages().items()
    return float(sum(st.passes for (s, p), st in stages if s == shard and slc in p))


def _replay(
    fitted: Unlearner,
    stream: IntArray,
    test: tuple[FloatArray, IntArray],
    settings: Settings,
    policy: str,
) -> Trace:
    fit_passes = float(sum(st.passes for st in fitted.stages().values()))
    model = copy.deepcopy(fitted)
    trace = Trace(0, {0: accuracy(model.predict(test[0]), test[1])}, {0: 0.0}, [])
    spent = 0.0
    alive = True
    for k, target in enumerate(stream, start=1):
        if policy == "per-deletion":
            spent += _hit_cost(fitted, *fitted.locate([target])[0])
        receipt = model.delete([target])
        if not receipt.all_dead:
            trace.delete_seconds.append(receipt.seconds)
        if receipt.all_dead:
            if alive:
                trace.served, alive = k, False
            if policy == "when-dead":
                spent += fit_passes
                model = copy.deepcopy(fitted)
        if k % settings.every == 0:
            trace.cost[k] = spent
            if alive:
                trace.accuracy[k] = accuracy(model.predict(test[0]), test[1])
    if alive:
        trace.served = len(stream) + 1
        logger.warning("a stream ended before the system died; served is a lower bound")
    return trace


def _methods(
    settings: Settings, backbone: Any, seed: int, prior: FloatArray | None
) -> dict[str, tuple[Unlearner, str]]:
    common: dict[str, Any] = {
        "epochs": settings.epochs,
        "lr": settings.lr,
        "seed": seed,
    }
    m, length, rank = settings.shards, settings.slices, settings.rank
    methods: dict[str, tuple[Unlearner, str]] = {
        "none": (FullRetrain(backbone, rank, **common), "per-deletion"),
        "sisa": (SISA(backbone, m, length, rank, **common), "per-deletion"),
        "s3t-b1": (S3T(backbone, m, length, 1, rank, **common), "when-dead"),
        "s3t": (
            S3T(backbone, m, length, settings.sequences, rank, **common),
            "when-dead",
        ),
    }
    if prior is not None:
        budget = min(settings.sequences, length)
        bms = S3T(
            backbone, m, length, budget, rank, "bms", slice_prior=list(prior), **common
        )
        methods["s3t-bms"] = (bms, "when-dead")
    return methods


def _seed_results(settings: Settings, seed: int) -> Iterator[Result]:
    rng = np.random.default_rng(seed)
    split = split_digits(rng, settings.public, 0.25, 0)
    pool = split.pool
    if settings.pool:
        pool = np.sort(rng.choice(pool, min(settings.pool, pool.size), replace=False))
    backbone = pretrained_backbone(
        int(rng.integers(2**31)), split.public, settings.backbone_spec()
    )
    data = split.data
    test = (data.X[split.test], data.y[split.test])
    prior = None
    if settings.skew == "zipf":
        ranks = rng.permutation(settings.slices) + 1
        prior = 1.0 / ranks.astype(np.float64) ** settings.zipf
        prior /= prior.sum()
    methods = _methods(settings, backbone, int(rng.integers(2**31)), prior)
    for model, _ in methods.values():
        model.fit(data.X[pool], data.y[pool], pool)
    probe = methods["s3t"][0]
    cells = np.array(
        [s * settings.slices + j for s, j in probe.locate(pool)], dtype=np.int64
    )
    streams = [
        _stream(rng, pool, cells, prior, settings.max_deletions)
        for _ in range(settings.streams)
    ]
    sim_rng = np.random.default_rng(seed + 1)
    weights = _weights(cells, prior)
    position = stream_positions(
        np.random.default_rng(seed + 2), weights, settings.bookkeeping_streams
    )
    hits = first_hits(cells, position)
    cell_probs: FloatArray = np.bincount(
        cells, weights, minlength=settings.shards * settings.slices
    ).astype(np.float64)
    many = _bookkeeping(methods, hits, cell_probs)
    for variant, (model, policy) in methods.items():
        traces = [
            _replay(model, s, test, settings, policy)
            for s in tqdm(
                streams, desc=f"s3t streams {variant}", disable=None, leave=False
            )
        ]
        extra = many.get(variant, {})
        yield _record(settings, seed, variant, model, traces, prior, sim_rng, extra)


def _record(
    settings: Settings,
    seed: int,
    variant: str,
    model: Unlearner,
    traces: list[Trace],
    prior: FloatArray | None,
    rng: np.random.Generator,
    extra: Mapping[str, float],
) -> Result:
    stages = model.stages()
    fit_passes = float(sum(st.passes for st in stages.values()))
    fit_seconds = float(sum(model.training_seconds()))
    served = [float(t.served) for t in traces]
    firsts = len({o[0] for o in model.orders})
    utility: dict[str, float] = {
        "accuracy": traces[0].accuracy[0],
        "deletions_served": statistics.fmean(served),
    }
    if prior is None:
        theory = deletion_rate_theory(model.shards, model.slices, firsts)
        utility["deletions_theory"] = theory
    if model.shards * model.slices > 1:
        sim, _ = simulate_deletion_rate(
            model.shards,
            model.orders,
            rng,
            settings.simulation_runs,
            None if prior is None else prior,
        )
        utility["deletions_simulated"] = float(sim.mean())
    utility.update(extra)
    cost: dict[str, float] = {
        "train_s": fit_seconds,
        "train_passes": fit_passes,
        "shard_train_s": fit_seconds / model.shards,
        "stored_stages": float(len(stages)),
        "deletions_served_std": statistics.stdev(served) if len(served) > 1 else 0.0,
    }
    for k in sorted({k for t in traces for k in t.cost}):
        values = [t.cost[k] for t in traces if k in t.cost]
        cost[f"retrain_passes@{k}"] = statistics.fmean(values)
        alive = [t.accuracy[k] for t in traces if k in t.accuracy]
        utility[f"alive@{k}"] = len(alive) / len(traces)
        if alive:
            utility[f"accuracy@{k}"] = statistics.fmean(alive)
    quick = [s for t in traces for s in t.delete_seconds]
    if quick:
        cost["delete_s"] = statistics.median(quick)
        cost["delete_over_shard_train"] = cost["delete_s"] / cost["shard_train_s"]
    return measurement(
        "s3t-deletion",
        variant,
        seed,
        utility=utility,
        cost=cost,
        params={
            "shards": settings.shards,
            "slices": settings.slices,
            "sequences": settings.sequences if variant.startswith("s3t") else 1,
            "skew": settings.skew,
            "method": variant,
        },
    )


def deletion_benchmark(params: Mapping[str, Any], seeds: list[int]) -> Iterator[Result]:
    """Run the deletion benchmark for one setting; one record per (method, seed)."""
    settings = Settings.parse(params)
    with single_thread():
        for seed in seeds:
            yield from _seed_results(settings, seed)
