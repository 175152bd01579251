"""The user's model and data: a small CNN on scikit-learn's 8x8 digits images."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset


class SmallCNN(nn.Module):
    """Two 3x3 convolutions with max-pooling, then a linear layer (10 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a batch of 1x8x8 images."""
        logits: torch.Tensor = self.head(self.features(x).flatten(1))
        return logits


def _images(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    X = torch.tensor(digits.images[order] / 16.0, dtype=torch.float32).unsqueeze(1)
    return X, torch.tensor(digits.target[order], dtype=torch.long)


def load_partition(partition: int, partitions: int, seed: int) -> TensorDataset:
    """A client's share of the training images (the first 80%, cut evenly)."""
    X, y = _images(seed)
    train = int(0.8 * len(y))
    part = np.array_split(np.arange(train), partitions)[partition]
    return TensorDataset(X[part], y[part])


def load_test(seed: int) -> TensorDataset:
    """The held-out 20% the server evaluates on (no client data)."""
    X, y = _images(seed)
    train = int(0.8 * len(y))
    return TensorDataset(X[train:], y[train:])


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    """Top-1 accuracy of ``model`` on ``data``."""
    X, y = data.tensors
    with torch.no_grad():
        return float((model(X).argmax(1) == y).float().mean())
