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

SWEEP_CAPTION = (
    "One encrypted fine-tuning step per arm: measured over small widths (filled: "
    "fitted, open: held out), the operation-count cost model along the measured "
    "shapes (dotted) and projected along BERT-like shapes (solid: FFN 4d, 128 "
    "tokens, d/64 heads, batch 16) to d = 768."
)
PAPER_RATIO = 6.94


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


def _sweep(results: list[Result], path: Path) -> Path:
    """Measured points, projection curves and the projected ratio at the paper."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours: dict[str, str] = {}
    for r in results:
        p = r.params.get("benchmark", {})
        name, role = str(p.get("variant", r.defense)), p.get("role")
        colour = colours.setdefault(name, f"C{len(colours)}")
        if role in ("fit", "held-out"):
            ax.plot(
                p["d"],
                r.cost["step_cpu_s"],
                "o",
                color=colour,
                mfc=colour if role == "fit" else "none",
            )
    for name, colour in colours.items():
        for role, style in (("curve", "-"), ("model", ":")):
            line = sorted(
                (r.params["benchmark"]["d"], r.cost["projected_step_cpu_s"])
                for r in results
                if r.defense == f"{role} {name}"
            )
            if line:
                xs, ys = zip(*line, strict=True)
                label = name if role == "curve" else None
                ax.plot(xs, ys, style, color=colour, label=label)
    paper = {
        r.params["benchmark"]["variant"]: r
        for r in results
        if r.params.get("benchmark", {}).get("role") == "projected"
    }
    if "lora-gk" in paper:
        r = paper["lora-gk"]
        ax.set_title(
            f"Fine-tuning step: measured up to d = "
            f"{r.params['benchmark']['measured_up_to_d']}, projected at d = "
            f"{r.params['benchmark']['d']}",
            fontsize=10,
        )
        ax.annotate(
            f"projected {r.utility['projected_speedup']:.2f}x\n(paper {PAPER_RATIO}x)",
            (r.params["benchmark"]["d"], r.cost["projected_step_cpu_s"]),
            textcoords="offset points",
            xytext=(-90, -40),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model width d")
    ax.set_ylabel("CPU seconds per encrypted step")
    ax.legend(
        fontsize=7,
        title="arm (solid: BERT-like shapes, dotted: measured shapes)",
        title_fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def figures(results: list[Result], out_dir: Path) -> list[tuple[str, Path]]:
    """Accuracy per arm (game), attention latency, LoRA vs full, the step sweep.

    The sweep gets one figure per spec (``crypto_sweep-quick.png``,
    ``crypto_sweep-full.png``): each profile is fitted and projected on its own, so
    their points and curves are never drawn on one axis.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    out: list[tuple[str, Path]] = []
    game: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    attention: dict[str, dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    lora: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    sweep: dict[str, list[Result]] = defaultdict(list)
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
        elif r.scenario == "crypto-finetune-sweep":
            sweep[spec].append(r)
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
    for spec, rows in sorted(sweep.items()):
        out.append((SWEEP_CAPTION, _sweep(rows, out_dir / f"{spec}.png")))
    return out
