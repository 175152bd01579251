"""Measurement benchmarks of RPS: ``rps-coverage``, ``rps-tradeoff``, ``rps-perf``.

* :func:`coverage_study` - clean coverage and set size over many random
  calibration/test splits (the part models are trained once per seed and each split
  is conformalized from cached votes), for each rank rule and for plain split CP;
* :func:`tradeoff` - clean coverage, set size and certified fractions against the
  numbers of training and calibration parts (the paper's trade-off);
* :func:`performance` - the cost of ``certify`` (sets included) and of
  ``predict_set`` + ``certify`` against the part models' own prediction time,
  measured side by side (interleaved repeats, medians; the classifier's one-batch
  memo of the models' votes is cleared before each timed step).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.datasets import make_classification
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
from tqdm.auto import tqdm

from defenses.arrays import FloatArray
from defenses.checks import check_int, check_real
from defenses.data import load, stratified_split
from defenses.harness import measurement
from defenses.metrics import coverage, mean_set_size
from defenses.results import Result
from defenses.rps.baselines import SplitConformalClassifier
from defenses.rps.certificate import ProbaGeometry, ScoreGeometry
from defenses.rps.defense import ReliableConformalClassifier
from defenses.rps.quantile import QUANTILE_MODES, textbook_rank
from defenses.rps.scores import vote_geometry

logger = logging.getLogger(__name__)


def _int(params: dict[str, Any], key: str, default: int) -> int:
    return check_int(f"benchmark parameter {key!r}", params.get(key, default), 1)


def _float(params: dict[str, Any], key: str, default: float) -> float:
    """A benchmark fraction in (0, 1) whose complement is also in (0, 1).

    ``1 - value`` must stay strictly inside (0, 1) in floating point too: a
    ``confidence_level`` of 1e-320 is positive, but ``1 - 1e-320`` rounds to 1.
    """
    name = f"benchmark parameter {key!r}"
    value = check_real(
        name, params.get(key, default), 0.0, 1.0, open_low=True, open_high=True
    )
    if not 0.0 < 1.0 - value < 1.0:
        raise ValueError(
            f"{name} = {value!r} is too close to 0 or 1: 1 - {value!r} rounds to "
            f"{1.0 - value!r}; use a value in [1e-15, 1 - 1e-15]"
        )
    return value


def _estimator() -> LogisticRegression:
    return LogisticRegression(max_iter=1000)


def _subset_geometry(
    model: ReliableConformalClassifier, cache: FloatArray, rows: npt.NDArray[np.int64]
) -> ScoreGeometry:
    if model.n_train_parts == 1:
        return ProbaGeometry(cache[rows])
    return vote_geometry(
        cache[rows].astype(np.int64), model.n_train_parts, model.softmax
    )


_PARTS: dict[tuple[Any, ...], ReliableConformalClassifier] = {}


def _fitted(
    key: tuple[Any, ...], X: FloatArray, y: npt.NDArray[np.int64], k_t: int
) -> ReliableConformalClassifier:
    """Part models trained once per (data, split, k_t) and shared across settings."""
    if key not in _PARTS:
        if len(_PARTS) >= 8:
            _PARTS.pop(next(iter(_PARTS)))
        _PARTS[key] = ReliableConformalClassifier(
            _estimator(), n_train_parts=k_t, n_calib_parts=1
        ).fit(X, y)
    return _PARTS[key]


def _sharing(
    parts: ReliableConformalClassifier, **params: Any
) -> ReliableConformalClassifier:
    """A classifier with the fitted ``parts`` (shared, not copied) and ``params``."""
    model = copy.copy(parts)
    model.set_params(**params)
    return model


def coverage_study(params: dict[str, Any], seeds: Sequence[int]) -> Iterator[Result]:
    """Coverage over ``n_splits`` random calibration/test splits per seed.

    Parameters (``params``): ``dataset`` (digits), ``n_train_parts`` (20),
    ``n_calib_parts`` (10), ``confidence_level`` (0.9), ``n_splits`` (200),
    ``train_fraction``
    (0.45), ``calib_fraction`` (0.33 of the data). One result per (variant, split);
    variants are the rank rules and ``none`` (plain split CP, textbook rank).
    """
    name = str(params.get("dataset", "digits"))
    k_t = _int(params, "n_train_parts", 20)
    k_c = _int(params, "n_calib_parts", 10)
    confidence = _float(params, "confidence_level", 0.9)
    alpha = 1.0 - confidence
    n_splits = _int(params, "n_splits", 200)
    train_fraction = _float(params, "train_fraction", 0.45)
    calib_fraction = _float(params, "calib_fraction", 0.33)
    data = load(name)
    setting = {
        "dataset": name,
        "n_train_parts": k_t,
        "n_calib_parts": k_c,
        "confidence_level": confidence,
    }
    for seed in seeds:
        rng = np.random.default_rng(seed)
        train, pool = stratified_split(
            data.y, [train_fraction, 1 - train_fraction], rng
        )
        key = (name, seed, train_fraction, 0.0, k_t)
        parts = _fitted(key, data.X[train], data.y[train], k_t)
        models = {
            mode: _sharing(
                parts, n_calib_parts=k_c, confidence_level=confidence, quantile=mode
            )
            for mode in QUANTILE_MODES
        }
        first = models["exact"]
        plain = SplitConformalClassifier(_estimator(), confidence).fit(
            data.X[train], data.y[train]
        )
        X, y = data.X[pool], data.y[pool]
        cache = (
            first.predict_scores(X)
            if k_t == 1
            else first.predict_votes(X).astype(np.float64)
        )
        plain_scores = plain.predict_scores(X)
        share = calib_fraction / (1 - train_fraction)
        for split in tqdm(
            range(n_splits), disable=None, desc="rps-coverage", leave=False
        ):
            split_rng = np.random.default_rng([seed, split])
            cal, test = stratified_split(y, [share, 1 - share], split_rng)
            record = dict(setting)
            cal_geometry = _subset_geometry(first, cache, cal)
            test_geometry = _subset_geometry(first, cache, test)
            test_scores = test_geometry.score()[test_geometry.index]
            for mode, model in models.items():
                try:
                    model.conformalize_geometry(X[cal], y[cal], cal_geometry, 0)
                except ValueError as error:
                    logger.warning("rps-coverage: %s skipped: %s", mode, error)
                    continue
                sets = test_scores >= model.part_thresholds_.cut
                yield measurement(
                    "rps-coverage",
                    mode,
                    seed * 100_000 + split,
                    utility={
                        "coverage": coverage(sets, y[test]),
                        "set_size": mean_set_size(sets),
                    },
                    certificate={"miscoverage_bound": model.miscoverage_bound_},
                    params={**record, "quantile": mode},
                )
            own = plain_scores[cal, y[cal]]
            rank = textbook_rank(cal.size, alpha)
            cut = np.sort(own)[rank - 1] if rank >= 1 else -np.inf  # full sets
            sets = plain_scores[test] >= cut
            yield measurement(
                "rps-coverage",
                "none",
                seed * 100_000 + split,
                utility={
                    "coverage": coverage(sets, y[test]),
                    "set_size": mean_set_size(sets),
                },
                params={**record, "quantile": "plain"},
            )


def tradeoff(params: dict[str, Any], seeds: Sequence[int]) -> Iterator[Result]:
    """Clean coverage, set size and certified fractions for one (k_t, k_c).

    Parameters: ``dataset``, ``n_train_parts``, ``n_calib_parts``,
    ``confidence_level``,
    ``quantile`` (exact), ``train_fraction``, ``calib_fraction``; ``radii`` is the
    list of radii at which certified fractions are reported.
    """
    name = str(params.get("dataset", "digits"))
    k_t = _int(params, "n_train_parts", 10)
    k_c = _int(params, "n_calib_parts", 10)
    confidence = _float(params, "confidence_level", 0.9)
    mode = params.get("quantile", "exact")
    if mode not in QUANTILE_MODES:
        raise ValueError(
            f"benchmark parameter 'quantile' must be one of {QUANTILE_MODES}"
        )
    train_fraction = _float(params, "train_fraction", 0.45)
    calib_fraction = _float(params, "calib_fraction", 0.33)
    radii = [int(r) for r in params.get("radii", [1, 2, 3, 5, 8])]
    data = load(name)
    for seed in seeds:
        rng = np.random.default_rng(seed)
        test_fraction = 1 - train_fraction - calib_fraction
        tr, ca, te = stratified_split(
            data.y, [train_fraction, calib_fraction, test_fraction], rng
        )
        start = time.perf_counter()
        key = (name, seed, train_fraction, calib_fraction, k_t)
        try:
            model = _sharing(
                _fitted(key, data.X[tr], data.y[tr], k_t),
                n_calib_parts=k_c,
                confidence_level=confidence,
                quantile=mode,
            )
            model.conformalize(data.X[ca], data.y[ca])
        except ValueError as error:
            logger.warning("rps-tradeoff: setting skipped: %s", error)
            continue
        fit_s = time.perf_counter() - start
        start = time.perf_counter()
        cert = model.certify(data.X[te])
        certify_s = time.perf_counter() - start
        certificate: dict[str, float] = {}
        for r in radii:
            certificate[f"robust_rt{r}"] = float(np.mean(cert.robust(r, 0)))
            certificate[f"coverage_reliable_rt{r}"] = float(
                np.mean(cert.coverage_reliable(r, 0))
            )
            certificate[f"size_reliable_rt{r}"] = float(
                np.mean(cert.size_reliable(r, 0))
            )
            certificate[f"robust_rc{r}"] = float(np.mean(cert.robust(0, r)))
            certificate[f"robust_joint{r}"] = float(np.mean(cert.robust(r, r)))
        votes_accuracy = float(
            np.mean(model.predict_scores(data.X[te]).argmax(axis=1) == data.y[te])
        )
        yield measurement(
            "rps-tradeoff",
            "rps" if (k_t, k_c) != (1, 1) else "none",
            seed,
            utility={
                "coverage": coverage(cert.sets, data.y[te]),
                "set_size": mean_set_size(cert.sets),
                "vote_accuracy": votes_accuracy,
            },
            cost={"fit_and_conformalize_s": fit_s, "certify_s": certify_s},
            certificate=certificate,
            params={
                "dataset": name,
                "n_train_parts": k_t,
                "n_calib_parts": k_c,
                "confidence_level": confidence,
                "quantile": mode,
            },
        )


def _time_steps(
    model: ReliableConformalClassifier, test: FloatArray, repeats: int
) -> dict[str, float]:
    """Median wall and CPU seconds of the models alone, certify, sets + certify."""
    steps: dict[str, tuple[Callable[[], object], ...]] = {
        "models": (lambda: model.predict_votes(test),),
        "certify": (lambda: model.certify(test),),
        "set_certify": (lambda: model.predict_set(test), lambda: model.certify(test)),
    }
    timings: dict[str, list[float]] = {
        f"{step}_{clock}": [] for step in steps for clock in ("wall", "cpu")
    }
    for _ in range(repeats):
        for step, calls in steps.items():
            model._parts.forget()
            wall, cpu = time.perf_counter(), time.process_time()
            for call in calls:
                call()
            timings[f"{step}_wall"].append(time.perf_counter() - wall)
            timings[f"{step}_cpu"].append(time.process_time() - cpu)
    return {key: float(np.median(values)) for key, values in timings.items()}


def performance(params: dict[str, Any], seeds: Sequence[int]) -> Iterator[Result]:
    """Time of the part models alone vs. ``certify`` and ``predict_set`` + ``certify``.

    Parameters: ``n_points`` (10000), ``n_train_parts`` (50), ``n_calib_parts``
    (20), ``n_features`` (64), ``repeats`` (5), ``threads`` (BLAS threads, 1).
    Synthetic 10-class data; the parts are logistic regressions. Timings are
    interleaved and the medians reported. With one thread the ratio compares the
    work of the conformal layer with that of the models; with more, the models'
    matrix products run in parallel while the conformal layer (numpy, mostly
    single-threaded) does not, so the wall ratio grows with idle cores.
    """
    n_points = _int(params, "n_points", 10_000)
    k_t = _int(params, "n_train_parts", 50)
    k_c = _int(params, "n_calib_parts", 20)
    d = _int(params, "n_features", 64)
    repeats = _int(params, "repeats", 5)
    threads = _int(params, "threads", 1)
    setting = {
        "n_points": n_points,
        "n_train_parts": k_t,
        "n_calib_parts": k_c,
        "n_features": d,
        "threads": threads,
    }
    for seed in seeds:
        X, y = make_classification(
            n_points + 3000,
            d,
            n_informative=min(d, 30),
            n_classes=10,
            n_clusters_per_class=1,
            random_state=seed,
        )
        model = ReliableConformalClassifier(
            _estimator(), n_train_parts=k_t, n_calib_parts=k_c
        )
        model.fit(X[:1500], y[:1500]).conformalize(X[1500:3000], y[1500:3000])
        test = X[3000:]
        with threadpool_limits(limits=threads, user_api="blas"):
            med = _time_steps(model, test, repeats)
        yield measurement(
            "rps-perf",
            "none",
            seed,
            cost={"time_s": med["models_wall"], "cpu_s": med["models_cpu"]},
            params=setting,
        )
        for step, label in (
            ("certify", "certify"),
            ("set_certify", "predict_set+certify"),
        ):
            yield measurement(
                "rps-perf",
                label,
                seed,
                cost={"time_s": med[f"{step}_wall"], "cpu_s": med[f"{step}_cpu"]},
                utility={
                    "ratio_to_models": med[f"{step}_wall"] / med["models_wall"],
                    "cpu_ratio_to_models": med[f"{step}_cpu"] / med["models_cpu"],
                },
                params=setting,
            )
