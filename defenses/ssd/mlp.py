"""Small torch MLPs for the inversion scenarios: the target and the evaluation model.

Both are float32 and train full-batch with Adam for a fixed number of epochs, seeded
by a :class:`torch.Generator` drawn from the caller's :class:`numpy.random.Generator`,
and run single-threaded (:func:`~defenses.threads.single_thread`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from defenses.threads import single_thread

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def make_mlp(
    n_in: int,
    hidden: Sequence[int],
    n_out: int,
    activation: str,
    generator: torch.Generator,
) -> torch.nn.Sequential:
    """An MLP ``n_in -> hidden... -> n_out`` (float32), seeded by ``generator``."""
    acts = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh}
    if activation not in acts:
        raise ValueError(
            f"activation must be one of {sorted(acts)}, got {activation!r}"
        )
    layers: list[torch.nn.Module] = []
    width = n_in
    for size in hidden:
        layers += [torch.nn.Linear(width, size), acts[activation]()]
        width = size
    layers.append(torch.nn.Linear(width, n_out))
    net = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for param in net.parameters():
            bound = 1.0 / np.sqrt(param.shape[-1])
            param.uniform_(-bound, bound, generator=generator)
    return net


def train_mlp(
    X: FloatArray,
    y: IntArray,
    n_classes: int,
    hidden: Sequence[int],
    rng: np.random.Generator,
    epochs: int = 300,
    lr: float = 1e-2,
    weight_decay: float = 1e-4,
    activation: str = "relu",
) -> torch.nn.Sequential:
    """Train an MLP classifier by full-batch Adam on cross-entropy."""
    generator = torch.Generator().manual_seed(int(rng.integers(2**62)))
    with single_thread():
        net = make_mlp(X.shape[1], hidden, n_classes, activation, generator)
        inputs = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32))
        labels = torch.from_numpy(np.asarray(y, dtype=np.int64))
        optimizer = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
        for _ in range(epochs):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(inputs), labels)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    net.eval()
    return net


def predict_proba(net: torch.nn.Module, X: FloatArray) -> FloatArray:
    """Softmax probabilities of ``net`` on ``X`` (float32 logits, float64 softmax)."""
    with single_thread(), torch.no_grad():
        logits = net(torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32)))
        out: FloatArray = torch.softmax(logits.double(), dim=1).numpy()
    return out


def features(net: torch.nn.Sequential, X: FloatArray) -> FloatArray:
    """Activations of the last hidden layer (the input of the final linear layer)."""
    with single_thread(), torch.no_grad():
        inputs = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32))
        out: FloatArray = net[:-1](inputs).double().numpy()
    return out
