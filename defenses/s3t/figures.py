"""The package's own plots of the deletion benchmark.

Accuracy and retraining cost along the deletion stream, and deletions served against
the theory ``m L H_{m B'}``.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from defenses.results import Result

_AT = re.compile(r"^(accuracy|retrain_passes)@(\d+)$")
LABELS = {
    "none": "full retrain",
    "sisa": "SISA",
    "s3t-b1": "S3T B=1",
    "s3t": "S3T",
    "s3t-bms": "S3T BMS",
}


def _setting(r: Result) -> str:
    p = r.params.get("benchmark", {})
    return f"m={p.get('shards')} L={p.get('slices')} {p.get('skew')}"


def _curves(
    runs: list[Result], metric: str
) -> dict[str, tuple[list[int], list[float]]]:
    by_variant: dict[str, dict[int, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in runs:
        for section in (r.utility, r.cost):
            for key, value in section.items():
                match = _AT.match(key)
                if match and match.group(1) == metric:
                    by_variant[r.defense][int(match.group(2))].append(value)
    out = {}
    for variant, points in by_variant.items():
        ks = sorted(points)
        out[variant] = (ks, [statistics.fmean(points[k]) for k in ks])
    return out


def _mean(group: list[Result], variant: str, key: str) -> float:
    values = [
        r.utility[key] for r in group if r.defense == variant and key in r.utility
    ]
    return statistics.fmean(values) if values else 0.0


def figures(results: list[Result], out_dir: Path) -> list[tuple[str, Path]]:
    """Draw the deletion-stream plots of every ``s3t_deletion`` setting."""
    runs = [
        r
        for r in results
        if str(r.meta.get("spec", "")).startswith("s3t_deletion")
        and r.scenario == "s3t-deletion"
    ]
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in runs:
        groups[f"{r.meta.get('spec')} {_setting(r)}"].append(r)
    made: list[tuple[str, Path]] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for number, (name, group) in enumerate(sorted(groups.items())):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for ax, metric, label in (
            (axes[0], "accuracy", "test accuracy (streams still alive)"),
            (axes[1], "retrain_passes", "retraining cost (sample-gradient passes)"),
        ):
            for variant, (ks, values) in sorted(_curves(group, metric).items()):
                ax.plot(
                    ks, values, marker="o", ms=3, label=LABELS.get(variant, variant)
                )
            ax.set_xlabel("deletions")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        variants = sorted({r.defense for r in group})
        served = [_mean(group, v, "deletions_served") for v in variants]
        simulated = [_mean(group, v, "deletions_simulated") for v in variants]
        theory = [_mean(group, v, "deletions_theory") for v in variants]
        xs = range(len(variants))
        width = 0.27
        axes[2].bar([x - width for x in xs], served, width=width, label="measured")
        axes[2].bar(list(xs), simulated, width=width, label="slice-level Monte Carlo")
        if any(theory):
            axes[2].bar(
                [x + width for x in xs], theory, width=width, label="m L H(m B')"
            )
        axes[2].set_xticks(list(xs), [LABELS.get(v, v) for v in variants], fontsize=7)
        axes[2].set_ylabel("deletions until every shard is dead")
        axes[2].legend(fontsize=7)
        fig.suptitle(name)
        fig.tight_layout()
        path = out_dir / f"s3t_deletion_{number}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append((f"S3T deletion stream: {name}", path))
    return made
