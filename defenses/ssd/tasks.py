"""Data worlds of the inversion game: private classes, public data, the judge's model.

* **digits** (the notes' World A): digits 0-4 are the private classes (K = 5),
  digits 5-9 the attacker's unlabelled public data, as in GMI's MNIST protocol.
* **identities** (World B): K = 50 private identities and 100 disjoint public ones
  from :func:`defenses.data.make_identities` (Gaussian blobs around secret
  prototypes), so K can approach the regime of the paper's face data sets.

The private data are split 80/10/10 into train (the target's), validation (SSD's
prototypes) and test (utility). The evaluation model, which judges reconstructions,
is an MLP of another activation (tanh), width and seed, trained on the private
training split.
Tasks are cached by a key drawn from the set-up generator, so every arm and attack of
one seed reuses the same task without retraining.

The target and the evaluation model are small float32 torch MLPs trained full-batch
with Adam for a fixed number of epochs, seeded by a :class:`torch.Generator` drawn
from the caller's :class:`numpy.random.Generator`, and run single-threaded
(:func:`~defenses.threads.single_thread`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from defenses.arrays import FloatArray, IntArray
from defenses.data import Dataset, load_digits, make_identities, stratified_split
from defenses.threads import single_thread

EVAL_HIDDEN = (64,)


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


@dataclass(frozen=True, eq=False)
class Evaluator:
    """The judge's classifier and its feature space.

    Attributes
    ----------
    net : torch.nn.Sequential
        An MLP trained on the private training split.
    reference : ndarray of shape (n, h)
        Features of the private training images and the public images.
    reference_labels : ndarray of shape (n,)
        Their classes; -1 marks public images.
    """

    net: torch.nn.Sequential
    reference: FloatArray
    reference_labels: IntArray

    def predict_proba(self, X: FloatArray) -> FloatArray:
        """Class probabilities."""
        return predict_proba(self.net, X)

    def features(self, X: FloatArray) -> FloatArray:
        """Penultimate-layer features."""
        return features(self.net, X)


@dataclass(frozen=True, eq=False)
class InversionTask:
    """Everything the challenger holds for one seed."""

    world: str
    train: Dataset
    val: Dataset
    test: Dataset
    public: FloatArray
    targets: IntArray
    bounds: tuple[float, float] | None
    evaluator: Evaluator

    @property
    def n_classes(self) -> int:
        """Number of private classes."""
        return self.train.n_classes


def _relabel(data: Dataset, keep: IntArray, n_classes: int) -> Dataset:
    return Dataset(data.X[keep], data.y[keep], data.name, n_classes, data.image_shape)


def _digits(
    rng: np.random.Generator,
) -> tuple[Dataset, FloatArray, tuple[float, float]]:
    data = load_digits()
    private = np.flatnonzero(data.y < 5)
    public = data.X[data.y >= 5]
    return (
        _relabel(data, private, 5),
        public[rng.permutation(public.shape[0])],
        (0.0, 1.0),
    )


def _identities(
    rng: np.random.Generator, n_classes: int, n_public: int
) -> tuple[Dataset, FloatArray, None]:
    data, _ = make_identities(
        rng, n_classes=n_classes + n_public, dim=32, per_class=40, spread=0.6
    )
    private = np.flatnonzero(data.y < n_classes)
    public = data.X[data.y >= n_classes]
    return _relabel(data, private, n_classes), public, None


@functools.lru_cache(maxsize=8)
def build_task(world: str, key: int, n_targets: int, per_target: int) -> InversionTask:
    """Draw the data of ``world`` from ``key`` and train the evaluation model.

    Parameters
    ----------
    world : {"digits", "identities"}
        Which data world.
    key : int
        Seed of the task's randomness.
    n_targets : int
        Number of target classes (the first ones).
    per_target : int
        Reconstructions asked per target class.
    """
    with single_thread():
        return _build(world, np.random.default_rng(key), n_targets, per_target)


def _build(
    world: str, rng: np.random.Generator, n_targets: int, per_target: int
) -> InversionTask:
    bounds: tuple[float, float] | None
    if world == "digits":
        private, public, bounds = _digits(rng)
    elif world == "identities":
        private, public, bounds = _identities(rng, 50, 100)
    else:
        raise ValueError(f"world must be 'digits' or 'identities', got {world!r}")
    k = private.n_classes
    if not 1 <= n_targets <= k:
        raise ValueError(f"n_targets must lie in [1, {k}], got {n_targets}")
    train_i, val_i, test_i = stratified_split(private.y, [0.8, 0.1, 0.1], rng)
    train = private.subset(train_i)
    net = train_mlp(
        train.X, train.y, k, EVAL_HIDDEN, rng, epochs=200, lr=1e-2, activation="tanh"
    )
    reference = np.concatenate([features(net, train.X), features(net, public)])
    labels = np.concatenate([train.y, np.full(public.shape[0], -1, dtype=np.int64)])
    return InversionTask(
        world=world,
        train=train,
        val=private.subset(val_i),
        test=private.subset(test_i),
        public=public,
        targets=np.repeat(np.arange(n_targets, dtype=np.int64), per_target),
        bounds=bounds,
        evaluator=Evaluator(net, reference, labels),
    )
