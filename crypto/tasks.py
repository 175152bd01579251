"""Offline sequence tasks for the HE-friendly transformer.

* :func:`digit_sequences` - scikit-learn's 8x8 digits read as sequences of 8 tokens
  (one pixel row per token, values in [0, 1]).
* :func:`client_transform` - the client-specific shift that makes personalisation
  matter: a left-right flip of every image.
* :func:`negation_sentiment` - a seeded synthetic text task: sentences of 8 words from
  a 24-word vocabulary whose label is the majority polarity, where ``not`` flips the
  next adjective; tokens are one-hot vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_int

POSITIVE = ("good", "great", "fine", "nice", "happy", "superb")
NEGATIVE = ("bad", "awful", "poor", "sad", "nasty", "boring")
FILLERS = (
    "the",
    "a",
    "movie",
    "plot",
    "was",
    "very",
    "and",
    "it",
    "so",
    "really",
    "film",
)
VOCABULARY = (*POSITIVE, *NEGATIVE, "not", *FILLERS)


@dataclass(frozen=True)
class Sequences:
    """Token sequences ``X`` of shape (n, n_tokens, token_dim) and labels ``y``."""

    X: FloatArray
    y: IntArray
    n_classes: int

    def __post_init__(self) -> None:
        n_classes = check_int("Sequences.n_classes", self.n_classes, 2)
        X = np.asarray(self.X)
        if X.ndim != 3:
            raise ValueError(
                f"Sequences.X must have shape (n, tokens, dim), got {X.shape}"
            )
        X = check_sequences(X, X.shape[1], X.shape[2])
        object.__setattr__(self, "X", X)
        object.__setattr__(self, "y", check_labels(self.y, X.shape[0], n_classes))
        object.__setattr__(self, "n_classes", n_classes)

    def subset(self, index: npt.ArrayLike) -> Sequences:
        """Return the sequences at ``index``."""
        i = np.asarray(index)
        return Sequences(self.X[i], self.y[i], self.n_classes)

    def __len__(self) -> int:
        return int(self.X.shape[0])


def check_sequences(X: npt.ArrayLike, n_tokens: int, token_dim: int) -> FloatArray:
    """``X`` as float64 sequences of shape (batch >= 1, n_tokens, token_dim), finite.

    Raises
    ------
    TypeError
        If ``X`` is not a real (bool, integer or float) array.
    ValueError
        Naming ``X`` for a wrong shape, no sequences, or NaN or inf after the cast.
    """
    arr = np.asarray(X)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"X must be a real array, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if arr.ndim != 3 or arr.shape[1:] != (n_tokens, token_dim):
        raise ValueError(
            f"X: expected sequences of shape (batch, {n_tokens}, {token_dim}), "
            f"got {arr.shape}"
        )
    if arr.shape[0] == 0:
        raise ValueError("X is empty: give at least one sequence")
    if not np.all(np.isfinite(arr)):
        raise ValueError("X has NaN or inf values")
    return arr


def check_labels(y: npt.ArrayLike, n: int, n_classes: int) -> IntArray:
    """``y`` as ``n`` integer labels in [0, n_classes) (integral floats accepted).

    Raises
    ------
    TypeError
        If ``y`` is not a real array.
    ValueError
        Naming ``y`` for a wrong length, fractional or non-finite values, or labels
        out of range.
    """
    arr = np.asarray(y)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"y must be an array of integer labels, got dtype {arr.dtype}")
    if arr.shape != (n,):
        raise ValueError(f"y: expected {n} labels, got shape {arr.shape}")
    values = arr.astype(np.float64)
    if not np.all(np.isfinite(values)) or np.any(values != np.round(values)):
        raise ValueError("y must hold whole-number labels (no NaN, inf or fractions)")
    if n and (values.min() < 0 or values.max() >= n_classes):
        raise ValueError(f"y: labels must lie in [0, {n_classes})")
    return values.astype(np.int64)


def digit_sequences() -> Sequences:
    """The 1,797 digits as sequences of 8 row tokens of 8 pixels in [0, 1]."""
    from defenses.data import load_digits  # scikit-learn, only when data is needed

    data = load_digits()
    return Sequences(data.X.reshape(-1, 8, 8).copy(), data.y, 10)


def client_transform(data: Sequences) -> Sequences:
    """Flip every image left to right (the client's scanner is mirrored).

    The embedding is frozen and client-side, so the pretrained model degrades (about
    0.26 accuracy at d = 8) and only the LoRA adapters and head can adapt.
    """
    return Sequences(data.X[:, :, ::-1].copy(), data.y.copy(), data.n_classes)


def negation_sentiment(
    rng: np.random.Generator,
    n: int = 1200,
    length: int = 8,
    lexicon_shift: bool = False,
) -> Sequences:
    """Seeded synthetic sentiment sentences with negation.

    Each position is an adjective (probability 0.4), ``not`` followed by an
    adjective (0.2) or a filler. The label is 1 when the signed count of adjectives
    (``not`` flips the next one) is positive; ties are redrawn. With
    ``lexicon_shift`` the client's lexicon swaps the two halves of each polarity's
    word list (a personal vocabulary the pretrained model never saw in that role).
    """
    check_int("n", n, 1)
    check_int("length", length, 2)
    index = {w: i for i, w in enumerate(VOCABULARY)}
    pos = list(POSITIVE[:3]) if not lexicon_shift else list(POSITIVE[3:])
    neg = list(NEGATIVE[:3]) if not lexicon_shift else list(NEGATIVE[3:])
    X = np.zeros((n, length, len(VOCABULARY)))
    y = np.zeros(n, dtype=np.int64)
    row = 0
    while row < n:
        words: list[str] = []
        score = 0
        while len(words) < length:
            draw = rng.random()
            polarity = 1 if rng.random() < 0.5 else -1
            adjective = str(rng.choice(pos if polarity > 0 else neg))
            if draw < 0.2 and len(words) <= length - 2:
                words += ["not", adjective]
                score -= polarity
            elif draw < 0.6:
                words.append(adjective)
                score += polarity
            else:
                words.append(str(rng.choice(FILLERS)))
        if score == 0:
            continue
        for position, word in enumerate(words):
            X[row, position, index[word]] = 1.0
        y[row] = int(score > 0)
        row += 1
    return Sequences(X, y, 2)


def negation_texts(
    rng: np.random.Generator, n: int = 1200, length: int = 8
) -> tuple[list[str], IntArray]:
    """:func:`negation_sentiment` as plain sentences (for a tokenizer) and labels.

    The same seeded sentences and rule, each a space-separated string of
    ``length`` words (``"the movie was not good ..."``).
    """
    data = negation_sentiment(rng, n, length)
    texts = [" ".join(VOCABULARY[i] for i in x.argmax(1)) for x in data.X]
    return texts, data.y
