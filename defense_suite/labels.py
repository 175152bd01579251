"""Words for metrics on plot axes: one label per metric, declared once, here.

A metric every shipped spec plots (its ``report.x`` and ``report.y``) has a label in
:data:`METRIC_LABELS` (a test checks it); any other metric falls back to its key in
words with its section (``success.acc@5`` becomes "acc at 5 (attack success)").
"""

from __future__ import annotations

import textwrap

METRIC_LABELS: dict[str, str] = {
    "utility.accuracy": "test accuracy (fraction correct)",
    "utility.set_size": "mean prediction-set size (labels)",
    "utility.coverage": "coverage (fraction of sets holding the true label)",
    "utility.l1_distortion": "L1 distortion of the output scores",
    "utility.certified_loss": "certified reconstruction error (sum of squares)",
    "utility.deletions_served": "deletions served before a full retrain",
    "success.auc": "membership-inference AUC (0.5 = chance)",
    "success.advantage": "membership advantage, max TPR - FPR",
    "success.tpr@1%fpr": "true-positive rate at 1% false positives",
    "success.eps_lb": "empirical ε lower bound (audit)",
    "success.acc@1": "top-1 accuracy on the reconstructions (fraction)",
    "success.attack_loss": "reconstruction error under PGD (sum of squares)",
    "success.label_advantage": "curious server's label advantage over chance",
    "success.recovery_rate": "inputs the server recovers exactly (fraction)",
    "success.target_changed_rate": "targeted set change rate (fraction of points)",
    "certificate.bound": "certified bound on the reconstruction error",
    "certificate.eps_strict": "privacy budget spent, strictest clients (ε)",
    "certificate.robust_fraction@rt1": "fraction certified against 1 poisoned part",
    "certificate.robust_rt3": "fraction certified against 3 poisoned parts",
    "cost.fit_s": "training time (s)",
}

SECTION_WORDS = {
    "utility": "utility",
    "success": "attack success",
    "cost": "cost",
    "certificate": "certificate",
}


def metric_label(path: str) -> str:
    """The axis label of the metric ``path`` (``section.key``)."""
    if path in METRIC_LABELS:
        return METRIC_LABELS[path]
    section, _, key = path.partition(".")
    words = key.replace("_", " ").replace("@", " at ").replace("%", " % ")
    words = " ".join(words.split())
    if key.endswith("_s"):
        words = f"{words[:-2]} time (s)"
    return f"{words} ({SECTION_WORDS.get(section, section)})"


def delta_label(path: str) -> str:
    """The axis label of a paired change in ``path``."""
    return f"change in {metric_label(path)}\n(defended minus undefended, same seed)"


def fit_title(title: str, width_inches: float, fontsize: float = 10.0) -> str:
    """Wrap ``title`` onto lines that fit a figure ``width_inches`` wide."""
    characters = max(20, int(width_inches * 72 / (0.55 * fontsize)))
    return "\n".join(textwrap.wrap(title, characters)) or title
