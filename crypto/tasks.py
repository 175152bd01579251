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

from defenses.checks import check_int
from defenses.data import load_digits

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

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
        if self.X.ndim != 3 or self.y.shape != (self.X.shape[0],):
            raise ValueError(
                f"Sequences need X of shape (n, tokens, dim) and y of shape (n,), "
                f"got {self.X.shape} and {self.y.shape}"
            )
        if self.X.shape[0] == 0:
            raise ValueError("Sequences is empty")
        if not np.all(np.isfinite(self.X)):
            raise ValueError("Sequences has NaN or inf values")
        if self.y.min() < 0 or self.y.max() >= self.n_classes:
            raise ValueError(f"labels must lie in [0, {self.n_classes})")

    def subset(self, index: npt.ArrayLike) -> Sequences:
        """Return the sequences at ``index``."""
        i = np.asarray(index)
        return Sequences(self.X[i], self.y[i], self.n_classes)

    def __len__(self) -> int:
        return int(self.X.shape[0])


def digit_sequences() -> Sequences:
    """The 1,797 digits as sequences of 8 row tokens of 8 pixels in [0, 1]."""
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
