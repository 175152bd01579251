"""A tiny pretrained backbone and digit splits for the S3T and composition tests.

One seeded permutation of scikit-learn's digits is cut, in order, into a public
split (the backbone's pretraining), a deletable fine-tuning pool, an optional
calibration split and a test split. The pool's ids are the rows' numbers in digits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from defenses.data import load_digits
from defenses.s3t.backbone import ResidualMLP, pretrain


@dataclass(frozen=True)
class TinyDigits:
    """The frozen backbone and the splits (``cal_X``/``cal_y`` may be empty)."""

    backbone: ResidualMLP
    X: np.ndarray
    y: np.ndarray
    ids: np.ndarray
    cal_X: np.ndarray
    cal_y: np.ndarray
    test_X: np.ndarray
    test_y: np.ndarray


def tiny_digits(
    public: int, pool: int, test: int, calibration: int = 0, n_blocks: int = 4
) -> TinyDigits:
    """Cut the splits and pretrain a width-24 ResidualMLP for 5 epochs (seed 0)."""
    data = load_digits()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(data))
    ends = np.cumsum([public, pool, calibration, test])
    public_rows, pool_rows, cal_rows, test_rows = np.split(order[: ends[-1]], ends[:-1])
    backbone = pretrain(
        data.X[public_rows],
        data.y[public_rows],
        rng,
        width=24,
        hidden=32,
        n_blocks=n_blocks,
        epochs=5,
    )
    return TinyDigits(
        backbone,
        data.X[pool_rows],
        data.y[pool_rows],
        pool_rows.astype(np.int64),
        data.X[cal_rows],
        data.y[cal_rows],
        data.X[test_rows],
        data.y[test_rows],
    )
