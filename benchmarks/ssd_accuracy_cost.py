"""SSD's test-accuracy cost per model family on digits, and what choose_epsilon picks.

Run from the repository root::

    .venv/bin/python benchmarks/ssd_accuracy_cost.py --seeds 3 > results/ssd_cost.md

For each seed: a stratified 50 / 25 / 25 split of scikit-learn's digits (train /
validation / test); each model is fitted on the training rows, a shield
(``StealthyShield``, the K rule's temperature, ``seeding="input-hash"``, hashing the
queries) on the validation outputs; the table gives the test accuracy without SSD
and the drop at each epsilon (undefended minus defended accuracy, mean and spread
over seeds), then the epsilon :func:`defenses.ssd.tuning.choose_epsilon` picks on the
validation rows for a target of two points (95 % confidence) and its drop on the test
rows, which it never saw.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from sklearn.datasets import load_digits
from sklearn.ensemble import HistGradientBoostingClassifier, RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from defenses.ssd import StealthyShield
from defenses.ssd.tuning import EpsilonSearch, choose_epsilon

EPSILONS = (0.1, 0.25, 0.5, 1.0, 2.0)
TARGET = 0.02

FAMILIES: dict[str, Callable[[int], Any]] = {
    "RandomForest(100)": lambda s: RandomForestClassifier(100, random_state=s),
    "LogisticRegression": lambda s: make_pipeline(
        StandardScaler(), LogisticRegression(max_iter=2000, random_state=s)
    ),
    "MLP(64)": lambda s: make_pipeline(
        StandardScaler(), MLPClassifier((64,), max_iter=600, random_state=s)
    ),
    "HistGradientBoosting": lambda s: HistGradientBoostingClassifier(random_state=s),
}


def measure(seed: int) -> list[dict[str, Any]]:
    """One seed: every family's test accuracy, drops and chosen epsilon."""
    X, y = load_digits(return_X_y=True)
    rows = np.arange(y.size)
    train, rest = train_test_split(rows, test_size=0.5, stratify=y, random_state=seed)
    val, test = train_test_split(
        rest, test_size=0.5, stratify=y[rest], random_state=seed
    )
    out = []
    for name, make in FAMILIES.items():
        start = time.perf_counter()
        model = make(seed).fit(X[train], y[train])
        val_probs, test_probs = (
            model.predict_proba(X[val]),
            model.predict_proba(X[test]),
        )
        plain = float(np.mean(test_probs.argmax(axis=1) == y[test]))
        drops = {}
        for epsilon in EPSILONS:
            shield = StealthyShield(epsilon=epsilon, seed=seed, seeding="input-hash")
            shield.fit(val_probs, y[val])
            answers = shield(test_probs, inputs=X[test]).argmax(axis=1)
            drops[str(epsilon)] = plain - float(np.mean(answers == y[test]))
        choice = choose_epsilon(
            val_probs,
            y[val],
            EpsilonSearch(max_accuracy_drop=TARGET),
            shield=StealthyShield(seed=seed, seeding="input-hash"),
            inputs=X[val],
        )
        answers = choice.shield(test_probs, inputs=X[test]).argmax(axis=1)
        out.append(
            {
                "seed": seed,
                "model": name,
                "test_accuracy": plain,
                "drop": drops,
                "chosen_epsilon": choice.epsilon,
                "chosen_drop": plain - float(np.mean(answers == y[test])),
                "seconds": time.perf_counter() - start,
            }
        )
    return out


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: mean ± std over seeds per model family."""

    def cell(values: list[float], points: bool = True) -> str:
        scale = 100.0 if points else 1.0
        a = np.asarray(values) * scale
        return f"{a.mean():.1f} ± {a.std():.1f}" if points else f"{a.mean():.3f}"

    head = ["model", "test acc (no SSD)"] + [f"drop ε={e}" for e in EPSILONS]
    head += ["chosen ε (median)", "its test drop"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in FAMILIES:
        mine = [r for r in records if r["model"] == name]
        row = [name, cell([r["test_accuracy"] for r in mine], points=False)]
        row += [cell([r["drop"][str(e)] for r in mine]) for e in EPSILONS]
        row.append(f"{np.median([r['chosen_epsilon'] for r in mine]):g}")
        row.append(cell([r["chosen_drop"] for r in mine]))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    """Run the seeds, print the table (drops in accuracy points) and the records."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    records = [r for seed in range(args.seeds) for r in measure(seed)]
    print(table(records))
    print()
    print("```json")
    print(json.dumps(records))
    print("```")


if __name__ == "__main__":
    main()
