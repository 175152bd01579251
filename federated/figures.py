"""The package's own report figures: accuracy curves and audit bounds.

Drawn from the results of the ``federated-*`` specs: mean test accuracy per round for
each method (from the ``acc@<t>`` utility entries), and the audit's epsilon lower
bounds next to the claimed epsilon of each accountant (correct and broken).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from defenses.results import Result

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


def figures(results: list[Result], out_dir: Path) -> list[tuple[str, Path]]:
    """Draw the package's figures into ``out_dir``; return (caption, path) pairs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mine = _ours(results)
    return _curves(mine, out_dir) + _audit(mine, out_dir)
