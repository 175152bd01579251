"""The package's own report figures: accuracy curves, audit bounds, the regime sweep.

Drawn from the results of the ``federated-*`` specs: mean test accuracy per round for
each method (from the ``acc@<t>`` utility entries), the audit's epsilon lower
bounds next to the claimed epsilon of each accountant (correct and broken), and the
paired difference time-adaptive minus uniform with its 95 % interval over the sweep
of rounds and saving ratio (:mod:`federated.regime`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from defenses.plotting import save_figure
from defenses.results import Result

from .regime import sweep_cells

_ROUND = re.compile(r"^acc@(\d+)$")


def _ours(results: list[Result]) -> list[Result]:
    return [r for r in results if str(r.meta.get("spec", "")).startswith("federated")]


def _curves(results: list[Result], out_dir: Path) -> list[tuple[str, Path]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list[tuple[str, Path]] = []
    by_setting: dict[tuple[str, str, str], dict[str, list[list[float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in results:
        if r.scenario != "federated-membership":
            continue
        rounds = sorted(
            (int(m.group(1)), v) for k, v in r.utility.items() if (m := _ROUND.match(k))
        )
        if rounds:
            scenario = r.params.get("scenario", {})
            key = (
                str(r.meta.get("spec", "")),
                str(scenario.get("dataset", "digits")),
                str(scenario.get("model", "softmax")),
            )
            by_setting[key][r.defense].append([v for _, v in rounds])
    for (spec, dataset, model), methods in sorted(by_setting.items()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for method, curves in sorted(methods.items()):
            length = min(len(c) for c in curves)
            mean = np.mean([c[:length] for c in curves], axis=0)
            ax.plot(np.arange(1, length + 1), mean, label=f"{method} (n={len(curves)})")
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (mean over seeds)")
        ax.set_title(f"Accuracy per round: {dataset}, {model} ({spec})")
        ax.legend(fontsize=6)
        fig.tight_layout()
        path = out_dir / f"federated_curves_{spec}_{dataset}_{model}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        caption = f"Test accuracy per round, {dataset}, {model} ({spec}); seed mean."
        figures.append((caption, path))
    return figures


def _audit(results: list[Result], out_dir: Path) -> list[tuple[str, Path]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.scenario == "federated-audit-controls"]
    if not rows:
        return []
    variants = sorted({r.defense for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, v in enumerate(variants):
        mine = [r for r in rows if r.defense == v]
        ax.scatter(
            [i] * len(mine), [r.success["eps_lb"] for r in mine], color="C0", s=12
        )
        ax.scatter(
            [i], [mine[0].certificate["eps_claimed"]], color="C3", marker="_", s=400
        )
    ax.set_xticks(range(len(variants)), variants, rotation=15)
    ax.set_ylabel("epsilon (dots: audit lower bound; bar: claimed)")
    ax.set_title("Canary audit: correct accountant vs. negative controls")
    fig.tight_layout()
    path = out_dir / "federated_audit_controls.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [("Audit lower bounds (dots) against the claimed epsilon (bars).", path)]


def _sweep(results: list[Result], out_dir: Path) -> list[tuple[str, Path]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sweep_cells(r for r in results if r.scenario == "federated-membership")
    by_panel = defaultdict(list)
    for c in cells:
        by_panel[(c.dataset, c.model, c.budgets)].append(c)
    panels = [k for k, v in by_panel.items() if len({c.rounds for c in v}) > 1]
    if not panels:
        return []
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False
    )
    for ax, key in zip(axes[0], panels, strict=True):
        lines = defaultdict(list)
        for c in by_panel[key]:
            lines[(c.options, c.rounds)].append(c)
        for i, ((options, rounds), line) in enumerate(sorted(lines.items())):
            line.sort(key=lambda c: c.save_ratio)
            x = np.array([c.save_ratio for c in line]) + 0.008 * (i - len(lines) / 2)
            mean = np.array([c.interval.mean for c in line])
            err = np.array(
                [
                    [c.interval.mean - c.interval.low for c in line],
                    [c.interval.high - c.interval.mean for c in line],
                ]
            )
            ax.errorbar(
                x,
                mean,
                yerr=err,
                capsize=3,
                marker="o",
                linestyle="-" if options == "plain" else "--",
                label=f"{rounds} rounds, {options} (n={line[0].interval.n})",
            )
        ax.axhline(0.0, color="k", linewidth=0.8)
        ax.set_xlabel("save ratio (saving rate / uniform rate)")
        ax.set_ylabel("accuracy: time-adaptive - uniform")
        ax.set_title(f"{key[0]}, {key[1]}, budgets {key[2]}", fontsize=9)
        ax.legend(fontsize=6)
    path = save_figure(fig, out_dir / "federated_regime_sweep.png", dpi=120)
    caption = (
        "Paired accuracy difference, time-adaptive minus uniform spending (same "
        "seed), with its 95 % t-interval, over rounds and saving ratio; above 0 it "
        "helps, below it hurts."
    )
    return [(caption, path)]


def figures(results: list[Result], out_dir: Path) -> list[tuple[str, Path]]:
    """Draw the package's figures into ``out_dir``; return (caption, path) pairs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mine = _ours(results)
    return _curves(mine, out_dir) + _audit(mine, out_dir) + _sweep(mine, out_dir)
