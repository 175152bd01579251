"""Offline data sets and deterministic splits.

Nothing here downloads: the real data are scikit-learn's bundled sets (digits, breast
cancer, wine) and the rest is generated from a :class:`numpy.random.Generator`:

* :func:`make_identities` - K "identities" (classes), each a Gaussian blob around a
  private prototype in dimension d: a stand-in for face identities in model-inversion
  experiments, where the secret is the prototype;
* :func:`make_coarse_to_fine` - superclasses each holding close fine classes (a fine
  class's mean is its superclass's mean plus a small offset).

scikit-learn is imported when a function needs it, so importing this module is
cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_int, check_real


def check_labelled(owner: str, X: Any, y: Any, n_classes: Any) -> None:
    """Raise unless ``X`` (n, d) and ``y`` (n,) are labelled data in [0, n_classes).

    The one check of the suite's labelled-data containers (:class:`Dataset`, a
    federated client's :class:`~defense_suite.federated.client.LocalData`): ``X`` a
    non-empty, finite numpy array of real numbers of shape (n, d); ``y`` a numpy
    array of n integer labels, each in [0, n_classes); ``n_classes`` an int >= 1.

    Raises
    ------
    TypeError
        If ``X`` or ``y`` is not a numpy array of the right kind, naming it as
        ``owner.X`` or ``owner.y``.
    ValueError
        For the wrong shapes, no rows, NaN or inf features, a bad ``n_classes`` or
        labels out of range, naming ``owner``.
    """
    check_int(f"{owner}.n_classes", n_classes, 1)
    for name, value, kinds, what in (
        ("X", X, "biuf", "real numbers"),
        ("y", y, "iu", "integer labels"),
    ):
        if not isinstance(value, np.ndarray) or value.dtype.kind not in kinds:
            raise TypeError(
                f"{owner}.{name} must be a numpy array of {what}, got "
                f"{getattr(value, 'dtype', type(value).__name__)}"
            )
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ValueError(
            f"{owner} needs X of shape (n, d) and y of shape (n,), got "
            f"{X.shape} and {y.shape}"
        )
    if X.shape[0] == 0:
        raise ValueError(f"{owner} has no rows in X (no data)")
    if not np.all(np.isfinite(X)):
        raise ValueError(f"{owner}.X has NaN or inf features")
    if y.min() < 0 or y.max() >= n_classes:
        raise ValueError(
            f"{owner}.y labels must lie in [0, {n_classes}), got [{y.min()}, {y.max()}]"
        )


@dataclass(frozen=True)
class Dataset:
    """Features ``X`` (n, d), integer labels ``y`` (n,) in [0, n_classes)."""

    X: FloatArray
    y: IntArray
    name: str
    n_classes: int
    image_shape: tuple[int, ...] | None = None
    coarse: IntArray | None = None

    def __post_init__(self) -> None:
        check_labelled(f"Dataset {self.name!r}", self.X, self.y, self.n_classes)

    def subset(self, index: npt.ArrayLike) -> Dataset:
        """Return the rows at ``index``."""
        i = np.asarray(index)
        return Dataset(
            self.X[i],
            self.y[i],
            self.name,
            self.n_classes,
            self.image_shape,
            None if self.coarse is None else self.coarse[i],
        )

    def __len__(self) -> int:
        return int(self.X.shape[0])


def _bundled(loader: Callable[[], object], name: str, scale: float | None) -> Dataset:
    bunch = loader()
    X = np.asarray(bunch.data, dtype=np.float64)  # type: ignore[attr-defined]
    y = np.asarray(bunch.target, dtype=np.int64)  # type: ignore[attr-defined]
    if scale is not None:
        X = X / scale
    else:
        X = (X - X.mean(axis=0)) / np.where(X.std(axis=0) > 0, X.std(axis=0), 1.0)
    return Dataset(X, y, name, int(y.max()) + 1)


def load_digits() -> Dataset:
    """The 1,797 8x8 handwritten digits, pixel values scaled to [0, 1]."""
    from sklearn.datasets import load_digits as loader

    data = _bundled(loader, "digits", 16.0)
    return Dataset(data.X, data.y, data.name, 10, image_shape=(8, 8))


def load_breast_cancer() -> Dataset:
    """The 569 Wisconsin breast-cancer cases (2 classes), standardized features."""
    from sklearn.datasets import load_breast_cancer as loader

    return _bundled(loader, "breast_cancer", None)


def load_wine() -> Dataset:
    """The 178 wines (3 classes), standardized features."""
    from sklearn.datasets import load_wine as loader

    return _bundled(loader, "wine", None)


LOADERS: dict[str, Callable[[], Dataset]] = {
    "digits": load_digits,
    "breast_cancer": load_breast_cancer,
    "wine": load_wine,
}


def load(name: str) -> Dataset:
    """Load a bundled data set by name."""
    if name not in LOADERS:
        raise ValueError(f"unknown data set {name!r}; available: {sorted(LOADERS)}")
    return LOADERS[name]()


MAX_ENTRIES = 50_000_000
"""Largest generated feature matrix (rows times dimension, 400 MB of float64)."""


def _check_size(owner: str, rows: int, dim: int) -> None:
    if rows * dim > MAX_ENTRIES:
        raise ValueError(
            f"{owner}: {rows} samples of dimension {dim} exceed {MAX_ENTRIES:,} "
            "entries; lower per_class, the class counts or dim"
        )


def _around(
    rng: np.random.Generator, means: FloatArray, per_class: int, noise: float
) -> tuple[FloatArray, IntArray]:
    r"""``per_class`` samples :math:`x = m_k + 	ext{noise}\cdot z` per mean, shuffled.

    Returns the samples and their labels (the row of their mean in ``means``).
    """
    y = np.repeat(np.arange(means.shape[0], dtype=np.int64), per_class)
    X = means[y] + noise * rng.standard_normal((y.size, means.shape[1]))
    order = rng.permutation(y.size)
    return X[order], y[order]


def make_identities(
    rng: np.random.Generator,
    n_classes: int = 50,
    dim: int = 32,
    per_class: int = 40,
    spread: float = 0.6,
) -> tuple[Dataset, FloatArray]:
    r"""Draw K identities and samples around them.

    Prototype :math:`\mu_k \sim \mathcal N(0, I_d)`; sample
    :math:`x = \mu_k + \text{spread}\cdot z`, :math:`z \sim \mathcal N(0, I_d)`.

    Returns
    -------
    (Dataset, ndarray of shape (n_classes, dim))
        The samples (shuffled) and the private prototypes.
    """
    check_int("n_classes", n_classes, 1)
    check_int("dim", dim, 1)
    check_int("per_class", per_class, 1)
    check_real("spread", spread, 0.0, open_low=True)
    _check_size("make_identities", int(n_classes) * int(per_class), int(dim))
    prototypes = rng.standard_normal((n_classes, dim))
    X, y = _around(rng, prototypes, per_class, spread)
    return Dataset(X, y, "identities", n_classes), prototypes


def make_coarse_to_fine(
    rng: np.random.Generator,
    n_coarse: int = 4,
    fine_per_coarse: int = 3,
    dim: int = 16,
    per_class: int = 60,
    coarse_spread: float = 3.0,
    fine_spread: float = 1.0,
    noise: float = 1.0,
) -> Dataset:
    r"""Draw superclasses holding close fine classes.

    Superclass mean :math:`m_c \sim \mathcal N(0, \text{coarse\_spread}^2 I)`, fine
    mean :math:`m_{c,f} = m_c + \mathcal N(0, \text{fine\_spread}^2 I)`, sample
    :math:`x = m_{c,f} + \text{noise}\cdot z`. Labels are the fine classes; the
    superclass of each sample is in ``coarse``.
    """
    for name, value in (
        ("n_coarse", n_coarse),
        ("fine_per_coarse", fine_per_coarse),
        ("dim", dim),
        ("per_class", per_class),
    ):
        check_int(name, value, 1)
    for name, spread in (
        ("coarse_spread", coarse_spread),
        ("fine_spread", fine_spread),
        ("noise", noise),
    ):
        check_real(name, spread, 0.0, open_low=True)
    _check_size(
        "make_coarse_to_fine",
        int(n_coarse) * int(fine_per_coarse) * int(per_class),
        int(dim),
    )
    coarse_means = coarse_spread * rng.standard_normal((n_coarse, dim))
    fine_of = np.repeat(np.arange(n_coarse), fine_per_coarse)
    fine_means = coarse_means[fine_of] + fine_spread * rng.standard_normal(
        (fine_of.size, dim)
    )
    X, y = _around(rng, fine_means, per_class, noise)
    return Dataset(
        X, y, "coarse_to_fine", int(fine_of.size), coarse=fine_of[y].astype(np.int64)
    )


def stratified_split(
    y: npt.ArrayLike, fractions: Sequence[float], rng: np.random.Generator
) -> list[IntArray]:
    """Split indices into parts of the given fractions, stratified by label.

    ``fractions`` must be positive and sum to 1. Part sizes are the differences of
    the rounded cumulative fractions of ``len(y)``; each part is cut from the rest
    by scikit-learn's stratified ``train_test_split`` (seeded from ``rng``), so every
    part holds its share of every class. Each part's indices are sorted.

    Raises
    ------
    ValueError
        If ``y`` is empty or not 1-D, the fractions are not positive or do not sum
        to 1, or a part is too small to hold every class (scikit-learn's rule: at
        least one member of each class per part, two members per class in ``y``).
    """
    from sklearn.model_selection import train_test_split

    labels = np.asarray(y)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"y must be a non-empty 1-D array, got shape {labels.shape}")
    if labels.dtype.kind == "c" or (
        labels.dtype.kind == "f" and not np.all(np.isfinite(labels))
    ):
        raise ValueError(
            f"y must hold finite real or string labels, got {labels.dtype}"
        )
    if isinstance(fractions, str) or not isinstance(fractions, Sequence | np.ndarray):
        raise TypeError(f"fractions must be a sequence of numbers, got {fractions!r}")
    f = np.array(
        [
            check_real(f"fractions[{i}]", v, 0.0, 1.0, open_low=True)
            for i, v in enumerate(fractions)
        ],
        dtype=np.float64,
    )
    if f.size == 0 or not np.isclose(f.sum(), 1.0):
        raise ValueError(
            f"fractions must be positive and sum to 1, got {list(fractions)}"
        )
    bounds = np.round(np.cumsum(f) * labels.size).astype(int)
    bounds[-1] = labels.size
    sizes = np.diff(np.r_[0, bounds])
    if np.any(sizes <= 0):
        raise ValueError(
            f"fractions {list(fractions)} of {labels.size} labels leave an empty part"
        )
    parts: list[IntArray] = []
    rest = np.arange(labels.size, dtype=np.int64)
    for size in sizes[:-1]:
        try:
            part, rest = train_test_split(
                rest,
                train_size=int(size),
                stratify=labels[rest],
                random_state=int(rng.integers(2**32 - 1)),
            )
        except ValueError as error:
            raise ValueError(
                f"cannot split {labels.size} labels into fractions {list(fractions)} "
                f"stratified by class: {error}"
            ) from error
        parts.append(np.sort(np.asarray(part, dtype=np.int64)))
    parts.append(np.sort(np.asarray(rest, dtype=np.int64)))
    return parts
