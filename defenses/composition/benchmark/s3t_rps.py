"""The benchmark of S3T shards serving as RPS parts: sets, certificates, deletions.

Per seed, on digits (:func:`defenses.s3t.tasks.split_digits`: a backbone pretrained
on public digits 0-4, a deletable fine-tuning pool, and the held-out rest split in
half, stratified, into calibration and test data):

1. fit the unlearner (S3T or SISA) on the pool and conformalize RPS once
   (``<m>-rps(before)``);
2. replay a uniform stream of ``deletions`` pool ids, one at a time, each followed
   by RPS's conformalization (no gradient step) and timed (``<m>-rps(after)``:
   ``cost.deletion_s`` is the mean time of one such deletion);
3. retrain the switched-off stages (:meth:`ReliableUnlearner.retrain`,
   ``<m>-rps(retrained)``; its ``cost.deletion_s`` is that retraining amortised
   over the stream's deletions) and, for reference, rebuild the composition from scratch
   on the remaining pool (``<m>-rps(rebuilt)``: its ``cost.deletion_s`` is the time
   of that full retraining plus conformalization, what one deletion costs without
   exact unlearning); ``utility.matches_rebuilt`` is 1 when the retrained sets and
   certificates equal the rebuilt ones exactly;
4. plain split conformal prediction on the unlearner's averaged probabilities,
   before and after the stream (``<m>-cp(...)``): valid coverage, no certificate.

Utility: coverage, mean set size, singleton rate, plain accuracy of the unlearner,
dead shards. Certificate: the fraction of test points whose whole set is certified
at training radius ``r = 1 .. radii`` (``robust_fraction@rt<r>``, no calibration
poisoning), and RPS's exact miscoverage bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from defenses.arrays import BoolArray, FloatArray, IntArray
from defenses.checks import check_choice, check_int, check_keys, check_real
from defenses.composition.s3t_rps import ReliableUnlearner
from defenses.data import stratified_split
from defenses.harness import game_streams, measurement
from defenses.metrics import accuracy, coverage, mean_set_size
from defenses.results import Result
from defenses.rps.quantile import textbook_rank
from defenses.s3t.baselines import SISA
from defenses.s3t.defense import S3T, Unlearner
from defenses.s3t.tasks import ModelSettings, pretrained_backbone, split_digits
from defenses.s3t.training import single_thread
from defenses.threat import Budget, Capability, Goal, Knowledge, Stage, ThreatModel

BENCHMARK = "composition-s3t-rps"

DEFAULTS: dict[str, Any] = {
    "unlearner": "s3t",
    "shards": 10,
    "slices": 3,
    "sequences": 0,
    "n_calib_parts": 10,
    "confidence_level": 0.9,
    "deletions": 20,
    "radii": 3,
    "public": 300,
    "width": 32,
    "hidden": 64,
    "blocks": 3,
    "pretrain_epochs": 10,
    "rank": 4,
    "epochs": 6,
    "batch_size": 32,
    "lr": 0.05,
}
UNLEARNERS = ("s3t", "sisa")


@dataclass(frozen=True, kw_only=True)
class Settings(ModelSettings):
    """Validated parameters (see :data:`DEFAULTS`; ``sequences`` 0 means L)."""

    unlearner: str
    shards: int
    slices: int
    sequences: int
    n_calib_parts: int
    confidence_level: float
    deletions: int
    radii: int
    batch_size: int

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> Settings:
        """Fill defaults and check every value."""
        check_keys(BENCHMARK, params, DEFAULTS)
        values = {**DEFAULTS, **params}
        check_choice(f"{BENCHMARK}.unlearner", values["unlearner"], UNLEARNERS)
        for name in ("confidence_level", "lr"):
            values[name] = check_real(
                f"{BENCHMARK}.{name}",
                values[name],
                0.0,
                1.0,
                open_low=True,
                open_high=True,
            )
        for name, value in values.items():
            if name not in ("unlearner", "confidence_level", "lr"):
                low = 0 if name == "sequences" else 1
                values[name] = check_int(f"{BENCHMARK}.{name}", value, minimum=low)
        if values["sequences"] == 0:
            values["sequences"] = values["slices"]
        return cls(**values)


def split_conformal(
    cal_proba: FloatArray, cal_y: IntArray, proba: FloatArray, confidence_level: float
) -> BoolArray:
    r"""Split-conformal sets :math:`\{y : p_y(x) \ge \tau\}` (THR / LAC score).

    :math:`\tau` is the :math:`\lfloor (n + 1)\alpha \rfloor`-th smallest
    calibration score :math:`p_{y_i}(x_i)`, :math:`\alpha = 1 -
    \text{confidence\_level}`, so the set covers with probability at least the
    confidence level on exchangeable data (Vovk et al., 2005).
    """
    n = cal_y.size
    alpha = 1.0 - confidence_level
    rank = textbook_rank(n, alpha)
    if rank < 1:
        raise ValueError(
            f"split conformal at confidence_level={confidence_level} needs at least "
            f"{int(np.ceil(1 / alpha - 1e-9)) - 1} calibration points, got {n}"
        )
    tau = np.sort(cal_proba[np.arange(n), cal_y])[rank - 1]
    return np.asarray(proba >= tau)


def _unlearner(settings: Settings, backbone: nn.Module, seed: int) -> Unlearner:
    common: dict[str, Any] = {
        "rank": settings.rank,
        "epochs": settings.epochs,
        "batch_size": settings.batch_size,
        "lr": settings.lr,
        "seed": seed,
    }
    if settings.unlearner == "sisa":
        return SISA(backbone, settings.shards, settings.slices, **common)
    return S3T(backbone, settings.shards, settings.slices, settings.sequences, **common)


def _set_metrics(sets: BoolArray, y: IntArray) -> dict[str, float]:
    size = sets.sum(axis=1)
    return {
        "coverage": coverage(sets, y),
        "set_size": mean_set_size(sets),
        "singleton_rate": float(np.mean(size == 1)),
        "empty_rate": float(np.mean(size == 0)),
    }


def _rps_record(
    variant: str,
    model: ReliableUnlearner,
    test: tuple[FloatArray, IntArray],
    settings: Settings,
    seed: int,
    extra: Mapping[str, float],
    cost: Mapping[str, float],
    params: Mapping[str, Any],
) -> Result:
    X, y = test
    cert = model.certify(X)
    utility = {
        **_set_metrics(cert.sets, y),
        "dead_shards": float(len(model.dead_shards)),
        **extra,
    }
    if len(model.dead_shards) < settings.shards:
        utility["accuracy"] = accuracy(model.predict(X), y)
    certificate = {
        f"robust_fraction@rt{r}": float(np.mean(cert.robust(r, 0)))
        for r in range(1, settings.radii + 1)
    }
    certificate["miscoverage_bound"] = float(model.rps.miscoverage_bound_)
    return measurement(
        BENCHMARK,
        variant,
        seed,
        utility=utility,
        certificate=certificate,
        cost=cost,
        params=params,
        threat=THREAT,
    )


THREAT = ThreatModel(
    goal=Goal.INTEGRITY,
    stage=Stage.TRAINING,
    knowledge=Knowledge.WHITE_BOX,
    capabilities=frozenset(
        {
            Capability.READ_PARAMETERS,
            Capability.POISON_TRAIN,
            Capability.POISON_CALIBRATION,
            Capability.REQUEST_DELETION,
        }
    ),
    budget=Budget(),
)
"""What the composition is built against: poisoned training and calibration points
(any labels and features, knowing the model) and deletion requests; the certified
radii say how many it withstands."""


def _cp_record(
    variant: str,
    model: ReliableUnlearner,
    calibration: tuple[FloatArray, IntArray],
    test: tuple[FloatArray, IntArray],
    settings: Settings,
    seed: int,
    deleted: int,
    params: Mapping[str, Any],
) -> Result:
    proba = model.unlearner.predict_proba(test[0])
    sets = split_conformal(
        model.unlearner.predict_proba(calibration[0]),
        calibration[1],
        proba,
        settings.confidence_level,
    )
    utility = {
        **_set_metrics(sets, test[1]),
        "accuracy": accuracy(np.argmax(proba, axis=1), test[1]),
        "dead_shards": float(len(model.dead_shards)),
        "deleted": float(deleted),
    }
    return measurement(
        BENCHMARK, variant, seed, utility=utility, params=params, threat=THREAT
    )


def _timed_build(
    settings: Settings,
    backbone: nn.Module,
    seed: int,
    train: tuple[FloatArray, IntArray, IntArray],
    calibration: tuple[FloatArray, IntArray],
) -> tuple[ReliableUnlearner, float, float]:
    model = ReliableUnlearner(
        _unlearner(settings, backbone, seed),
        n_calib_parts=settings.n_calib_parts,
        confidence_level=settings.confidence_level,
    )
    began = time.perf_counter()
    model.fit(*train)
    fitted = time.perf_counter()
    model.conformalize(*calibration, max_train_radius=settings.radii)
    return model, fitted - began, time.perf_counter() - fitted


def s3t_rps(params: Mapping[str, Any], seeds: Sequence[int]) -> Iterator[Result]:
    """Yield the records of every variant, seed by seed (see the module docstring).

    Parameters
    ----------
    params : mapping
        Any of :data:`DEFAULTS`.
    seeds : sequence of int
        One run per seed: the split, the backbone, the shards and the stream.
    """
    settings = Settings.parse(params)
    m = settings.unlearner
    record_params = dict(params)
    for seed in seeds:
        r_split, r_stream = game_streams(seed, 2)
        split = split_digits(r_split, settings.public, 0.5, 0)
        data = split.data
        halves = stratified_split(data.y[split.test], [0.5, 0.5], r_split)
        cal_rows, test_rows = (split.test[h] for h in halves)
        calibration = (data.X[cal_rows], data.y[cal_rows])
        test = (data.X[test_rows], data.y[test_rows])
        if settings.deletions >= split.pool.size:
            raise ValueError(
                f"{BENCHMARK}.deletions={settings.deletions} must be below the pool "
                f"size {split.pool.size}"
            )
        backbone = pretrained_backbone(
            seed,
            split.public,
            settings.backbone_spec(),
        )
        with single_thread():
            pool = (data.X[split.pool], data.y[split.pool], split.pool)
            model, train_s, conformalize_s = _timed_build(
                settings, backbone, seed, pool, calibration
            )
            yield _rps_record(
                f"{m}-rps(before)",
                model,
                test,
                settings,
                seed,
                {"deleted": 0.0},
                {"train_s": train_s, "conformalize_s": conformalize_s},
                record_params,
            )
            yield _cp_record(
                f"{m}-cp(before)",
                model,
                calibration,
                test,
                settings,
                seed,
                0,
                record_params,
            )
            stream = r_stream.permutation(split.pool)[: settings.deletions]
            seconds = []
            for target in stream:
                began = time.perf_counter()
                model.delete([int(target)])
                seconds.append(time.perf_counter() - began)
            keep = ~np.isin(split.pool, stream)
            remaining = (pool[0][keep], pool[1][keep], pool[2][keep])
            rebuilt, rebuild_train_s, rebuild_cal_s = _timed_build(
                settings, backbone, seed, remaining, calibration
            )
            rebuild_s = rebuild_train_s + rebuild_cal_s
            deletion_s = float(np.mean(seconds))
            yield _rps_record(
                f"{m}-rps(after)",
                model,
                test,
                settings,
                seed,
                {
                    "deleted": float(stream.size),
                    "served_fraction": _served_fraction(model),
                },
                {
                    "deletion_s": deletion_s,
                    "deletion_s_max": float(np.max(seconds)),
                    "rebuild_over_deletion": rebuild_s / deletion_s,
                },
                record_params,
            )
            yield _cp_record(
                f"{m}-cp(after)",
                model,
                calibration,
                test,
                settings,
                seed,
                stream.size,
                record_params,
            )
            began = time.perf_counter()
            model.retrain()
            retrain_s = time.perf_counter() - began
            a, b = model.certify(test[0]), rebuilt.certify(test[0])
            same = bool(
                np.array_equal(a.sets, b.sets)
                and np.array_equal(a.training, b.training)
                and np.array_equal(a.calibration, b.calibration)
            )
            yield _rps_record(
                f"{m}-rps(retrained)",
                model,
                test,
                settings,
                seed,
                {"deleted": float(stream.size), "matches_rebuilt": float(same)},
                {"retrain_s": retrain_s, "deletion_s": retrain_s / stream.size},
                record_params,
            )
            yield _rps_record(
                f"{m}-rps(rebuilt)",
                rebuilt,
                test,
                settings,
                seed,
                {"deleted": float(stream.size)},
                {"deletion_s": rebuild_s, "train_s": rebuild_train_s},
                record_params,
            )


def _served_fraction(model: ReliableUnlearner) -> float:
    """Mean length of the prefixes served, over shards, as a fraction of L."""
    unlearner = model.unlearner
    lengths = [len(p) for p in unlearner.served()]
    return float(np.mean(lengths) / unlearner.slices)
