"""The RPS package's plots for the report (registered under ``rps``)."""

from __future__ import annotations

import pathlib
from collections import defaultdict
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from defenses.plotting import save_figure
from defenses.results import Result


def _spec(result: Result) -> str:
    return str(result.meta.get("spec", ""))


def _tradeoff(
    rows: list[Result], out_dir: pathlib.Path
) -> list[tuple[str, pathlib.Path]]:
    out = []
    for dataset in sorted({str(r.params["benchmark"]["dataset"]) for r in rows}):
        groups: dict[tuple[int, float], dict[int, list[Result]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for r in rows:
            b = r.params["benchmark"]
            if b["dataset"] == dataset:
                group = (int(b["n_calib_parts"]), float(b["confidence_level"]))
                groups[group][int(b["n_train_parts"])].append(r)
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for (k_c, level), by_kt in sorted(groups.items()):
            kts = sorted(by_kt)
            for ax, key, section in (
                (axes[0], "coverage", "utility"),
                (axes[1], "set_size", "utility"),
                (axes[2], "robust_rt2", "certificate"),
            ):
                values = [[r.get(f"{section}.{key}") for r in by_kt[k]] for k in kts]
                if any(not v for v in values):
                    continue
                mean = [float(np.mean(v)) for v in values]
                std = [float(np.std(v)) for v in values]
                ax.errorbar(
                    kts,
                    mean,
                    yerr=std,
                    marker="o",
                    capsize=3,
                    label=f"k_c={k_c}, confidence {level}",
                )
        for ax, title in zip(
            axes,
            ("clean coverage", "mean set size", "robust fraction at r_t=2"),
            strict=True,
        ):
            ax.set_xlabel("training parts k_t")
            ax.set_title(title)
            ax.set_xscale("symlog", linthresh=1)
        for level in sorted({a for _, a in groups}):
            axes[0].axhline(level, color="grey", linestyle="--", linewidth=1)
        axes[0].legend(fontsize=8)
        path = save_figure(fig, out_dir / f"rps_tradeoff_{dataset}.png")
        caption = (
            f"RPS trade-off on {dataset}: coverage, set size and certified "
            "fraction vs. k_t, k_c (mean ± std over seeds)"
        )
        out.append((caption, path))
    return out


def _coverage(
    rows: list[Result], out_dir: pathlib.Path
) -> list[tuple[str, pathlib.Path]]:
    def setting(r: Result) -> str:
        b = r.params["benchmark"]
        return f"kt{b['n_train_parts']} kc{b['n_calib_parts']} c{b['confidence_level']}"

    several = len({setting(r) for r in rows}) > 1
    by_variant: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        name = f"{r.defense}\n{setting(r)}" if several else r.defense
        by_variant[name].append(r.get("utility.coverage"))
    names = sorted(by_variant)
    fig, ax = plt.subplots(figsize=(max(6.5, 0.7 * len(names)), 3.8))
    ax.boxplot([by_variant[n] for n in names], tick_labels=names, showmeans=True)
    ax.tick_params(axis="x", labelsize=6 if several else 10)
    levels = {float(r.params["benchmark"]["confidence_level"]) for r in rows}
    for level in sorted(levels):
        ax.axhline(level, color="red", linestyle="--", linewidth=1)
    ax.plot([], [], color="red", linestyle="--", label="confidence level")
    ax.set_ylabel("test coverage per split")
    ax.set_title(
        f"Clean coverage over {len(by_variant[names[0]])} calibration/test splits"
    )
    ax.legend()
    path = save_figure(fig, out_dir / "rps_coverage.png")
    means = ", ".join(
        f"{n.replace(chr(10), ' ')} {np.mean(by_variant[n]):.3f}" for n in names
    )
    return [(f"RPS clean coverage by rank rule (means: {means})", path)]


def _certified(
    results: list[Result], out_dir: pathlib.Path
) -> list[tuple[str, pathlib.Path]]:
    rows = [r for r in results if r.defense == "rps"]
    if not rows:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    groups: dict[tuple[str, int, int], list[Result]] = defaultdict(list)
    for r in rows:
        b = r.params["benchmark"]
        groups[
            (str(b["dataset"]), int(b["n_train_parts"]), int(b["n_calib_parts"]))
        ].append(r)
    for (dataset, k_t, k_c), runs in sorted(groups.items()):
        for ax, prefix in ((axes[0], "robust_rt"), (axes[1], "robust_rc")):
            keys = sorted(
                (int(k[len(prefix) :]), k)
                for k in runs[0].certificate
                if k.startswith(prefix)
            )
            if not keys:
                continue
            radii = [0] + [r for r, _ in keys]
            values = [1.0] + [
                float(np.mean([run.certificate[k] for run in runs])) for _, k in keys
            ]
            ax.plot(radii, values, marker="o", label=f"{dataset} k_t={k_t} k_c={k_c}")
    axes[0].set_xlabel("poisoned training points r_t")
    axes[1].set_xlabel("poisoned calibration points r_c")
    for ax in axes:
        ax.set_ylabel("fraction of test points certified robust")
        ax.set_ylim(0, 1.02)
    axes[1].legend(fontsize=7)
    path = save_figure(fig, out_dir / "rps_certified.png")
    caption = (
        "RPS certified robust fraction vs. poisoning radius "
        "(training only, calibration only)"
    )
    return [(caption, path)]


Drawing = Callable[[list[Result], pathlib.Path], list[tuple[str, pathlib.Path]]]

DRAWINGS: tuple[tuple[str, Drawing], ...] = (
    ("rps-tradeoff", _tradeoff),
    ("rps-coverage", _coverage),
    ("rps-tradeoff", _certified),
)
"""Each figure and the scenario whose runs it draws (it is skipped without any)."""


def figures(
    results: list[Result], out_dir: pathlib.Path
) -> list[tuple[str, pathlib.Path]]:
    """Trade-off curves, the coverage distribution and certified-fraction curves."""
    mine = [r for r in results if _spec(r).startswith("rps")]
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn: list[tuple[str, pathlib.Path]] = []
    for scenario, draw in DRAWINGS:
        rows = [r for r in mine if r.scenario == scenario]
        if rows:
            drawn += draw(rows, out_dir)
    return drawn
