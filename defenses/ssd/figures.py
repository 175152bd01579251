"""The SSD package's own report figures.

* Per game spec: attack accuracy (``acc@1``) against test accuracy, one panel per
  attack, means over seeds; the SSD arms (the epsilon sweep) and the Gaussian-noise
  arms are joined by lines, so defenses can be compared at matched test accuracy.
* Per speed spec: time per row against K for every variant (log-log).
"""

from __future__ import annotations

import pathlib
from collections import defaultdict

import numpy as np

from defenses.plotting import save_figure
from defenses.registry import register
from defenses.results import Result

FAMILIES = ("ssd-shield", "ssd-art-gaussian-noise")


def _family(defense: str) -> str:
    return defense.split("(")[0]


def _trade_off(results: list[Result], spec: str, out_dir: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = sorted({r.attack.split("(")[0] for r in results})
    fig, axes = plt.subplots(
        1, len(attacks), figsize=(5 * len(attacks), 4), squeeze=False
    )
    for ax, attack in zip(axes[0], attacks, strict=True):
        arms: dict[str, list[Result]] = defaultdict(list)
        for r in results:
            if r.attack.split("(")[0] == attack:
                arms[r.defense].append(r)
        lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for defense, runs in arms.items():
            x = float(np.mean([r.utility["accuracy"] for r in runs]))
            y = float(np.mean([r.success["acc@1"] for r in runs]))
            family = _family(defense)
            if family in FAMILIES:
                lines[family].append((x, y))
                continue
            ax.scatter(
                [x], [y], label=defense, marker="s" if defense == "none" else "o"
            )
        for family, points in sorted(lines.items()):
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="^", label=f"{family} (sweep)")
        ax.set_xlabel("test accuracy (defended answers)")
        ax.set_ylabel("attack acc@1 (evaluation model)")
        ax.set_title(attack)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=6, loc="best")
    fig.suptitle(spec)
    return save_figure(fig, out_dir / f"{spec}-tradeoff.png", dpi=120)


def _speed(results: list[Result], spec: str, out_dir: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        k = int(r.params["benchmark"]["K"])
        series[r.defense][k].append(r.cost["per_row_us"])
    fig, ax = plt.subplots(figsize=(5, 4))
    for variant, by_k in sorted(series.items()):
        ks = sorted(by_k)
        label = "numpy.sort (floor)" if variant == "none" else variant
        ax.plot(ks, [np.mean(by_k[k]) for k in ks], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("K (classes)")
    ax.set_ylabel("time per row (us)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.suptitle(spec)
    return save_figure(fig, out_dir / f"{spec}-speed.png", dpi=120)


@register("figures", "ssd")
def figures(
    results: list[Result], out_dir: pathlib.Path
) -> list[tuple[str, pathlib.Path]]:
    """Draw the SSD figures for every SSD spec found in ``results``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    by_spec: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        spec = str(r.meta.get("spec", ""))
        if spec.split("-")[0].split("_")[0] == "ssd":
            by_spec[spec].append(r)
    drawn: list[tuple[str, pathlib.Path]] = []
    for spec, runs in sorted(by_spec.items()):
        if all(r.scenario == "ssd-perf" for r in runs):
            caption = f"{spec}: water-filling time per row vs. numpy.sort and cvxpy"
            drawn.append((caption, _speed(runs, spec, out_dir)))
        elif all("acc@1" in r.success and "accuracy" in r.utility for r in runs):
            caption = (
                f"{spec}: attack acc@1 vs. test accuracy (means over seeds; lines join "
                "the SSD and Gaussian-noise sweeps)"
            )
            drawn.append((caption, _trade_off(runs, spec, out_dir)))
    return drawn
