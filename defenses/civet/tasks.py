"""The CIVET scenarios' data: images in [0, 1] and the task a VAE is trained on.

Offline and seeded: scikit-learn's 8x8 digits, or synthetic clusters from
:func:`defenses.data.make_identities` squashed into (0, 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.special import expit

from defenses.data import load_digits, make_identities

FloatArray = npt.NDArray[np.float64]

DATASETS = ("digits", "blobs")


def load_images(name: str, rng: np.random.Generator) -> tuple[FloatArray, np.ndarray]:
    """Rows in [0, 1] and labels: sklearn digits, or 10 synthetic 64-d clusters.

    ``blobs``: :func:`defenses.data.make_identities` (10 prototypes, 150 samples
    each, spread 0.6) passed through a logistic squash :math:`1/(1 + e^{-1.5x})`.
    """
    if name == "digits":
        data = load_digits()
        return data.X, data.y
    if name == "blobs":
        data, _ = make_identities(rng, n_classes=10, dim=64, per_class=150, spread=0.6)
        return np.asarray(expit(1.5 * data.X), dtype=np.float64), data.y
    raise ValueError(f"unknown data set {name!r}; available: {DATASETS}")


@dataclass(frozen=True)
class VAETask:
    """Training rows, the inputs under attack, the budget and the judge's seed."""

    train: FloatArray
    x_eval: FloatArray
    eps: float
    p: float
    image_shape: tuple[int, int] | None
    judge_seed: int
    reference_loss: FloatArray
