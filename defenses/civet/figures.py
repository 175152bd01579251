"""CIVET's own plots for the report: certificate and attack against the radius."""

from __future__ import annotations

import pathlib
from collections import defaultdict

import matplotlib as mpl

mpl.use("Agg")

import matplotlib.pyplot as plt
import numpy as np

from defenses.results import Result

LABELS = {"none": "standard", "pgd": "PGD-trained", "civet": "CIVET"}
COLOURS = {"none": "tab:gray", "pgd": "tab:blue", "civet": "tab:red"}


def _sweep(results: list[Result]) -> list[Result]:
    return [
        r
        for r in results
        if str(r.meta.get("spec", "")).startswith("civet_eps")
        and r.scenario == "civet-eps"
    ]


def _data(result: Result) -> str:
    return str(result.params["benchmark"].get("data", "digits"))


def _curve(
    runs: list[Result], variant: str, metric: str
) -> tuple[list[float], list[float], list[float]]:
    by_eps: dict[float, list[float]] = defaultdict(list)
    for r in runs:
        if r.defense == variant:
            by_eps[float(r.params["benchmark"]["eval_eps"])].append(r.get(metric))
    radii = sorted(by_eps)
    return (
        radii,
        [float(np.mean(by_eps[e])) for e in radii],
        [float(np.std(by_eps[e])) for e in radii],
    )


def draw(
    results: list[Result], out_dir: pathlib.Path
) -> list[tuple[str, pathlib.Path]]:
    """Plot the certified bound and the joint attack's error against the radius.

    One PNG per ``civet_eps`` spec and data set (log scale; mean and standard
    deviation over seeds), with the mean-image predictor as a reference line.
    """
    runs = _sweep(results)
    out: list[tuple[str, pathlib.Path]] = []
    groups = sorted({(str(r.meta["spec"]), _data(r)) for r in runs})
    for spec, data in groups:
        subset = [r for r in runs if r.meta["spec"] == spec and _data(r) == data]
        fig, ax = plt.subplots(figsize=(6.0, 4.0))
        for variant in ("none", "pgd", "civet"):
            colour, label = COLOURS[variant], LABELS[variant]
            for metric, style, what in (
                ("certificate.bound", "-", "certified $U_{p}$"),
                ("success.attack_loss", "--", "joint PGD"),
            ):
                radii, mean, std = _curve(subset, variant, metric)
                if radii:
                    ax.errorbar(
                        radii,
                        mean,
                        yerr=std,
                        fmt=style,
                        marker="o",
                        color=colour,
                        label=f"{label}: {what}",
                        capsize=3,
                    )
        reference = [r.get("utility.mean_image_loss") for r in subset]
        if reference:
            ax.axhline(
                float(np.mean(reference)),
                color="k",
                lw=0.8,
                ls=":",
                label="mean-image predictor",
            )
        ax.set_yscale("log")
        ax.set_xlabel("L-infinity radius eps")
        ax.set_ylabel("squared reconstruction error")
        ax.set_title(f"{spec}: {data}, certificate vs attack")
        ax.legend(fontsize=7)
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{spec}_{data}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out.append(
            (
                f"{spec} ({data}): certified p-level bound (solid) and the strongest "
                "attack (joint input+noise PGD, dashed) against eps; mean and std "
                "over seeds.",
                path,
            )
        )
    return out
