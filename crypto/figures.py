"""The package's own plots for the report (matplotlib, Agg backend)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from defenses.results import Result

GAME_CAPTION = (
    "Served accuracy (GK model), frozen model, softmax twin and the server's label "
    "advantage per arm (mean and std over seeds)."
)
ATTENTION_CAPTION = (
    "Encrypted attention per sequence: Gaussian kernel (N=8192) vs polynomial "
    "softmax (N=16384 non-interactive; N=8192 with client-aided refreshes)."
)
LORA_CAPTION = (
    "Encrypted forward and weight-gradient time of one linear layer: LoRA (r=2) vs "
    "full encrypted weights."
)


def _mean(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values))


def _bars(
    groups: dict[str, dict[str, list[float]]], title: str, ylabel: str, path: Path
) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(groups)
    keys = sorted({k for g in groups.values() for k in g})
    width = 0.8 / max(len(keys), 1)
    for i, key in enumerate(keys):
        stats = [_mean(groups[n].get(key, [0.0])) for n in names]
        ax.bar(
            np.arange(len(names)) + i * width,
            [m for m, _ in stats],
            width,
            yerr=[s for _, s in stats],
            label=key,
        )
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def figures(results: list[Result], out_dir: Path) -> list[tuple[str, Path]]:
    """Accuracy per arm (game), attention latency, LoRA vs full timings."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out: list[tuple[str, Path]] = []
    game: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    attention: dict[str, dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    lora: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        spec = str(r.meta.get("spec", ""))
        if not spec.startswith("crypto"):
            continue
        if r.scenario == "crypto-private-inference":
            arm = r.defense.split("(")[0]
            for key in ("accuracy", "accuracy_frozen", "accuracy_softmax"):
                game[arm][key].append(r.utility[key])
            game[arm]["label_advantage"].append(r.success["label_advantage"])
        elif r.scenario == "crypto-attention":
            variant = str(r.params.get("benchmark", {}).get("variant", r.defense))
            attention[variant]["ms_per_sequence"].append(r.cost["ms_per_sequence"])
        elif r.scenario == "crypto-lora":
            p = r.params.get("benchmark", {})
            name = f"{p.get('variant', r.defense)} d={p.get('d', '?')}"
            lora[name]["forward_s"].append(r.cost["forward_s"])
            lora[name]["gradient_s"].append(r.cost["gradient_s"])
    if game:
        path = _bars(
            game,
            "Private inference: utility and attack",
            "rate",
            out_dir / "crypto_game.png",
        )
        out.append(
            (
                GAME_CAPTION,
                path,
            )
        )
    if attention:
        path = _bars(
            attention,
            "Encrypted attention latency",
            "ms per sequence",
            out_dir / "crypto_attention.png",
        )
        out.append(
            (
                ATTENTION_CAPTION,
                path,
            )
        )
    if lora:
        path = _bars(
            lora, "Encrypted linear layer", "seconds", out_dir / "crypto_lora.png"
        )
        out.append(
            (
                LORA_CAPTION,
                path,
            )
        )
    return out
