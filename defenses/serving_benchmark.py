r"""The load benchmark: a served model with and without SSD, side by side in one run.

One scikit-learn classifier (logistic regression on ``n_features`` Gaussian features,
``n_classes`` classes) is saved twice: as a plain ``mlflow.sklearn`` model whose
pyfunc answers ``predict_proba`` (the variant ``none``), and shielded by
:mod:`defenses.ssd.mlflow` with input-hash seeding (the variant ``ssd``). Both are
served at once by ``mlflow models serve --workers W --env-manager local`` on
127.0.0.1 (:class:`~defenses.model_server.ModelServer`). For each batch size and
each load level (``concurrency``: keep-alive connections sending back to back),
:func:`~defenses.model_server.load` sends ``requests`` identical ``{"inputs": ...}``
requests to each server, after ``warmup`` unrecorded requests each, in ``rounds``
chunks with the arms alternating chunk by chunk (both see the same drift of the
machine's other load), with a time cap per chunk.

Each record holds requests per second, the p50/p95/p99 latency (ms) and the error
count (any answer but 200, or no answer by the cap); the ``ssd`` records add
``p50_overhead`` :math:`= p_{50}^{ssd} / p_{50}^{none} - 1` at the same setting, and
``answers_match`` (1 when the served answer equals the in-process shield's on the
same rows). At ``target_batch`` (256) rows the target is an overhead of at most
:data:`TARGET_OVERHEAD` with no errors at every load (``utility.target_met``); the
records at that batch and the lowest load carry ``target_p50_ms`` for the report's
summary. Latencies include the load generator's own time on the same machine.

Because a shared machine's other load moves latencies by tens of percent, each
record also holds ``handler_cpu_ms``: the process CPU time of MLflow's own request
handler (``invocations``: JSON in, model, JSON out) on the same request, in process
(:func:`_handler_cpu`), and the ``ssd`` records ``handler_cpu_overhead``.
"""

from __future__ import annotations

import json
import logging
import pathlib
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np

from defenses.checks import check_int, check_keys, check_real
from defenses.harness import measurement
from defenses.plotting import save_figure
from defenses.registry import register
from defenses.results import Result

logger = logging.getLogger(__name__)

BENCHMARK = "serve-load"
TARGET_OVERHEAD = 0.10
"""Target: the shield adds at most 10 % to the p50 latency at ``target_batch`` rows."""
ARMS = ("none", "ssd")
DEFAULTS: dict[str, Any] = {
    "batches": [1, 256],
    "concurrency": [1, 4],
    "requests": 100,
    "warmup": 10,
    "workers": 2,
    "time_cap_s": 60.0,
    "n_features": 20,
    "n_classes": 10,
    "target_batch": 256,
    "rounds": 10,
    "cpu_repeats": 20,
}


def _ints(params: dict[str, Any], name: str, high: int) -> list[int]:
    values = params.get(name, DEFAULTS[name])
    if not isinstance(values, list) or not values:
        raise ValueError(
            f"{BENCHMARK}: {name} must be a non-empty list, got {values!r}"
        )
    return [check_int(f"{BENCHMARK}.{name}", v, 1, high) for v in values]


def _setting(params: dict[str, Any]) -> dict[str, Any]:
    check_keys(BENCHMARK, params, DEFAULTS)
    setting: dict[str, Any] = {
        "batches": _ints(params, "batches", 1024),
        "concurrency": _ints(params, "concurrency", 64),
        "time_cap_s": check_real(
            f"{BENCHMARK}.time_cap_s",
            params.get("time_cap_s", DEFAULTS["time_cap_s"]),
            0.0,
            open_low=True,
        ),
    }
    for name, low, high in (
        ("requests", 1, 100_000),
        ("warmup", 0, 10_000),
        ("workers", 1, 16),
        ("n_features", 1, 1000),
        ("n_classes", 2, 1000),
        ("target_batch", 1, 1024),
        ("rounds", 1, 1000),
        ("cpu_repeats", 1, 10_000),
    ):
        value = params.get(name, DEFAULTS[name])
        setting[name] = check_int(f"{BENCHMARK}.{name}", value, low, high)
    if setting["target_batch"] not in setting["batches"]:
        raise ValueError(
            f"{BENCHMARK}: target_batch={setting['target_batch']} must be one of the "
            f"batches {setting['batches']}"
        )
    return setting


@register("benchmarks", BENCHMARK)
def serve_load(params: dict[str, Any], seeds: list[int]) -> Iterator[Result]:
    """Serve a model with and without SSD and load both (see the module notes).

    Parameters
    ----------
    params : dict
        ``batches`` (rows per request, default [1, 256]), ``concurrency`` (load
        levels, default [1, 4]), ``requests`` (per arm and setting, default 100),
        ``warmup`` (default 10), ``workers`` (server workers, default 2),
        ``time_cap_s`` (per load run, default 60), ``n_features`` (default 20),
        ``n_classes`` (default 10), ``target_batch`` (default 256, one of
        ``batches``), ``rounds`` (the arms alternate this many times per
        setting, default 10), ``cpu_repeats`` (of the handler's CPU time, default
        20).
    seeds : list of int
        One run per seed (data, model and shield key).
    """
    setting = _setting(params)
    for seed in seeds:
        yield from _records(seed, setting)


def _models(seed: int, setting: dict[str, Any], folder: pathlib.Path) -> Any:
    """Save the plain and the shielded model; returns the rows and the shield's call."""
    import mlflow.sklearn
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression

    from defenses.ssd import mlflow as ssd_mlflow
    from defenses.ssd.defense import StealthyShield

    d, k = setting["n_features"], setting["n_classes"]
    X, y = make_classification(
        3000 + max(setting["batches"]), d, n_informative=min(d, 8), n_redundant=0,
        n_classes=k, n_clusters_per_class=1, random_state=seed,
    )  # fmt: skip
    est = LogisticRegression(max_iter=300).fit(X[:2000], y[:2000])
    shield = StealthyShield(seed=seed, seeding="input-hash", n_threads=1)
    shield.fit(est.predict_proba(X[2000:3000]), y[2000:3000])
    mlflow.sklearn.save_model(
        est, str(folder / "none"), serialization_format="cloudpickle",
        pyfunc_predict_fn="predict_proba",
    )  # fmt: skip
    ssd_mlflow.save_model(est, folder / "ssd", shield=shield)
    rows = X[3000:]
    return rows, lambda batch: shield(est.predict_proba(batch), inputs=batch)


def _records(seed: int, setting: dict[str, Any]) -> Iterator[Result]:
    from defenses.model_server import ModelServer, batch_body, load

    cap = setting["time_cap_s"]
    measured: dict[tuple[str, int, int], Any] = {}
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        rows, shielded = _models(seed, setting, pathlib.Path(tmp))
        bodies = {b: batch_body(rows[:b]) for b in setting["batches"]}
        cpu = _handler_cpu(pathlib.Path(tmp), bodies, setting["cpu_repeats"])
        servers = {
            arm: ModelServer(str(pathlib.Path(tmp) / arm), setting["workers"])
            for arm in ARMS
        }
        try:
            for server in servers.values():
                server.launch()
            for server in servers.values():
                server.wait()
            status, text = servers["ssd"].post(bodies[max(bodies)])
            served = (
                np.array(json.loads(text)["predictions"]) if status == 200 else None
            )
            match = served is not None and np.array_equal(
                served, shielded(rows[: max(bodies)])
            )
            for batch, body in bodies.items():
                for level in setting["concurrency"]:
                    for arm in ARMS:
                        if setting["warmup"]:
                            load(servers[arm].port, body, setting["warmup"], level, cap)
                    runs = _interleaved(servers, body, level, setting)
                    for arm, result in runs.items():
                        measured[(arm, batch, level)] = result
                        logger.info(
                            "%s batch=%d concurrency=%d: p50 %.2f ms, %.1f req/s, "
                            "%d errors",
                            arm, batch, level, result.percentile_ms(50),
                            result.rps, result.errors,
                        )  # fmt: skip
        finally:
            for server in servers.values():
                server.stop()
    yield from _results(seed, setting, measured, bool(match), cpu)


def _handler_cpu(
    folder: pathlib.Path, bodies: dict[int, bytes], repeats: int
) -> dict[tuple[str, int], float]:
    """CPU ms of MLflow's request handler per request, per arm and batch.

    :func:`mlflow.pyfunc.scoring_server.invocations` is what a server worker runs
    for each request (JSON parsing, the model, JSON encoding); called here in
    process on the same bodies, the arms alternating, it is timed by process CPU
    time (the minimum over ``repeats`` runs of 5 calls), which the machine's other
    load does not inflate.
    """
    import mlflow.pyfunc
    from mlflow.pyfunc.scoring_server import invocations

    models = {arm: mlflow.pyfunc.load_model(str(folder / arm)) for arm in ARMS}
    out: dict[tuple[str, int], float] = {}
    for batch, body in bodies.items():
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for index in range(repeats):
            for arm in ARMS if index % 2 == 0 else ARMS[::-1]:
                start = time.process_time()
                for _ in range(5):
                    answer = invocations(body, "application/json", models[arm], None)  # type: ignore[no-untyped-call]
                times[arm].append((time.process_time() - start) / 5 * 1e3)
                if answer.status != 200:
                    raise RuntimeError(f"{arm}: the handler answered {answer.status}")
        out.update({(arm, batch): min(values) for arm, values in times.items()})
    return out


def _interleaved(
    servers: dict[str, Any], body: bytes, level: int, setting: dict[str, Any]
) -> dict[str, Any]:
    """Each arm's requests in ``rounds`` chunks, the arms alternating chunk by chunk.

    On a shared machine the load from other work drifts; alternating the arms
    every ``requests / rounds`` requests exposes both to the same drift. The
    chunks of an arm are pooled into one :class:`~defenses.model_server.LoadResult`.
    """
    from defenses.model_server import LoadResult, load

    rounds = min(setting["rounds"], setting["requests"])
    chunks = [len(c) for c in np.array_split(np.arange(setting["requests"]), rounds)]
    parts: dict[str, list[Any]] = {arm: [] for arm in ARMS}
    for index, size in enumerate(chunks):
        for arm in ARMS if index % 2 == 0 else ARMS[::-1]:
            port = servers[arm].port
            parts[arm].append(load(port, body, size, level, setting["time_cap_s"]))
    return {
        arm: LoadResult(
            np.concatenate([r.latencies_s for r in runs]),
            sum(r.errors for r in runs),
            sum(r.wall_s for r in runs),
        )
        for arm, runs in parts.items()
    }


def _results(
    seed: int,
    setting: dict[str, Any],
    measured: dict[tuple[str, int, int], Any],
    match: bool,
    cpu: dict[tuple[str, int], float],
) -> Iterator[Result]:
    target, lowest = setting["target_batch"], min(setting["concurrency"])
    for (arm, batch, level), result in measured.items():
        cost = {
            "p50_ms": result.percentile_ms(50),
            "p95_ms": result.percentile_ms(95),
            "p99_ms": result.percentile_ms(99),
            "rps": result.rps,
            "rows_per_s": result.rps * batch,
            "errors": float(result.errors),
            "wall_seconds": result.wall_s,
            "handler_cpu_ms": cpu[(arm, batch)],
        }
        utility: dict[str, float] = {}
        if batch == target and level == lowest:
            cost["target_p50_ms"] = cost["p50_ms"]
        if arm == "ssd":
            base = measured[("none", batch, level)]
            overhead = result.percentile_ms(50) / base.percentile_ms(50) - 1.0
            cost["p50_overhead"] = overhead
            cost["handler_cpu_overhead"] = cpu[(arm, batch)] / cpu[("none", batch)] - 1
            utility["answers_match"] = float(match)
            if batch == target:
                met = overhead <= TARGET_OVERHEAD and result.errors == 0
                utility["target_met"] = float(met)
        yield measurement(
            BENCHMARK,
            arm,
            seed,
            cost=cost,
            utility=utility,
            params={
                "batch": batch,
                "concurrency": level,
                "requests": setting["requests"],
                "workers": setting["workers"],
                "n_features": setting["n_features"],
                "n_classes": setting["n_classes"],
            },
        )


@register("figures", "serve")
def figures(
    results: list[Result], out_dir: pathlib.Path
) -> list[tuple[str, pathlib.Path]]:
    """p50 and p95 latency against load, one panel per batch size, per serve spec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_spec: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        if r.scenario == BENCHMARK:
            by_spec[str(r.meta.get("spec", BENCHMARK))].append(r)
    drawn: list[tuple[str, pathlib.Path]] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for spec, runs in sorted(by_spec.items()):
        batches = sorted({int(r.params["benchmark"]["batch"]) for r in runs})
        fig, axes = plt.subplots(
            1, len(batches), figsize=(4.5 * len(batches), 3.8), squeeze=False
        )
        for ax, batch in zip(axes[0], batches, strict=True):
            for colour, arm in enumerate(sorted({r.defense for r in runs})):
                points: dict[int, list[Result]] = defaultdict(list)
                for r in runs:
                    b = r.params["benchmark"]
                    if r.defense == arm and int(b["batch"]) == batch:
                        points[int(b["concurrency"])].append(r)
                levels = sorted(points)
                for metric, style in (("p50_ms", "-o"), ("p95_ms", ":^")):
                    values = [
                        np.mean([r.cost[metric] for r in points[c]]) for c in levels
                    ]
                    ax.plot(
                        levels, values, style, color=f"C{colour}",
                        label=f"{arm} {metric[:3]}",
                    )  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent connections")
            ax.set_ylabel("latency (ms)")
            ax.set_title(f"batch {batch}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"{spec}: served latency vs. load")
        path = save_figure(fig, out_dir / f"{spec}-latency.png", dpi=120)
        drawn.append(
            (f"{spec}: p50/p95 latency against load, with and without SSD", path)
        )
    return drawn
