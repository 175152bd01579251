r"""The fitted part classifiers of RPS, seen as votes and scores.

An RPS ensemble is either the :math:`k_t` classifiers it trained on hash parts or a
:class:`~defenses.rps.ensemble.PartVoter` trained elsewhere (whose parts may
abstain). :class:`FittedParts` turns either into votes per part and into the score
geometry of a batch (:mod:`defenses.rps.scores`): with one trained part the score is
that model's ``predict_proba`` (THR / LAC), otherwise the (softmax of the) vote
fractions. The geometry of the last numeric batch is kept, so ``predict_set``
followed by ``certify`` on the same points runs the models once (the batch's copy,
compared bit for bit before reuse, is written into one buffer reused across batches
of the same shape).

:func:`modal_share` measures how degenerate the parts are: the mean, over the parts
that vote, of the share of points given the part's most common vote. Near 1 the
votes do not depend on the input (parts too small to learn) and the sets grow.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import IntArray
from defenses.jit import compiled
from defenses.rps.certificate import ProbaGeometry, ScoreGeometry
from defenses.rps.ensemble import (
    ABSTAIN,
    PartClassifier,
    PartVoter,
    predict_parts,
    proba_columns,
    voter_votes,
)
from defenses.rps.scores import counted_geometry, vote_counts

DEGENERATE_SHARE = 0.95
"""Modal share (:func:`modal_share`) from which the parts count as degenerate."""


class DegeneratePartsWarning(UserWarning):
    """The part models give (nearly) the same vote whatever the input."""


class FittedParts:
    """The part classifiers of a fitted RPS: trained models or a voter.

    Parameters
    ----------
    models : list of part classifiers or None
        The trained parts (labels ``0..K-1``).
    voter : PartVoter or None
        Parts trained elsewhere (exactly one of ``models`` and ``voter``).
    n_classes : int
        K.
    """

    def __init__(
        self,
        models: list[PartClassifier] | None,
        voter: PartVoter | None,
        n_classes: int,
    ) -> None:
        if (models is None) == (voter is None):
            raise ValueError("give exactly one of models and voter")
        self.models = models
        self.voter = voter
        self.n_classes = n_classes
        self._n_parts = int(voter.n_parts) if voter is not None else len(models or [])
        self._last: tuple[npt.NDArray[Any], bool, ScoreGeometry] | None = None
        self._buffer: npt.NDArray[Any] | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the kept batch, its buffer and the lock."""
        state = dict(self.__dict__)
        state.update(_last=None, _buffer=None)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restored with a new lock."""
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def n_parts(self) -> int:
        """``k_t``, fixed when the parts were fitted (a voter must keep it)."""
        return self._n_parts

    @property
    def abstain(self) -> bool:
        """Whether parts may abstain (a voter's, or a trained part left empty)."""
        return self.voter is not None or any(m == ABSTAIN for m in self.models or [])

    @property
    def single(self) -> bool:
        """One trained model: scores are its probabilities, no training defense."""
        return self.models is not None and len(self.models) == 1

    def forget(self) -> None:
        """Drop the kept batch (the next call runs the models).

        The buffer its copy was written to stays, for the next batch of that shape
        and dtype (no fresh pages for every batch).
        """
        self._last = None

    def votes(self, X: Any, n_parts: int) -> IntArray:
        """Class index per part and point (-1: abstain), shape (n_parts, n)."""
        if self.voter is not None:
            return voter_votes(self.voter, X, n_parts)
        assert self.models is not None
        return predict_parts(self.models, X)

    def geometry(
        self, X: Any, softmax: bool, votes: IntArray | None = None
    ) -> ScoreGeometry:
        """Scores of ``X`` and their bounds (``votes``: already computed ones).

        The last numeric batch of trained models is kept and compared bit for bit
        before reuse (:func:`_same_bits`); a voter's votes are never kept (its
        parts may change between calls).
        """
        key = (
            X
            if self.voter is None
            and isinstance(X, np.ndarray)
            and X.dtype.kind in "biuf"
            else None
        )
        if key is not None:
            with self._lock:  # no other call rewrites the buffer while we compare
                last = self._last
                if (
                    last is not None
                    and last[0].shape == key.shape
                    and last[0].dtype == key.dtype
                    and last[1] == softmax
                    and _same_bits(last[0], key)
                ):
                    return last[2]
        geometry: ScoreGeometry
        if self.single:
            assert self.models is not None
            geometry = ProbaGeometry(proba_columns(self.models[0], X, self.n_classes))
        else:
            k_t = self.n_parts
            v = self.votes(X, k_t) if votes is None else votes
            counts = vote_counts(v, self.n_classes, abstain=self.abstain)
            geometry = counted_geometry(counts, k_t, softmax, self.abstain)
        if key is not None:
            with self._lock:
                self._last = (self._kept(key), softmax, geometry)
        return geometry

    def _kept(self, batch: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """A private copy of ``batch``, in the buffer of the last copy if it fits.

        Called under the lock, with ``_last`` about to be replaced: a reader that
        holds the lock sees the buffer and the geometry of one batch.
        """
        buffer = self._buffer
        if buffer is None or buffer.shape != batch.shape or buffer.dtype != batch.dtype:
            buffer = np.empty_like(batch, order="C")
            self._buffer = buffer
        np.copyto(buffer, batch)
        return buffer


@compiled
def same_words(kept: npt.NDArray[np.uint64], given: npt.NDArray[np.uint64]) -> bool:
    """Whether two 1-d uint64 arrays of one length are equal, word for word.

    Blocks of 64 words are OR-ed as XORs before one branch (vectorized, no
    temporary array); the first block that differs ends the scan.
    """
    n = kept.shape[0]
    i = 0
    while i + 64 <= n:
        differ = np.uint64(0)
        for j in range(i, i + 64):
            differ |= kept[j] ^ given[j]
        if differ != 0:
            return False
        i += 64
    differ = np.uint64(0)
    for j in range(i, n):
        differ |= kept[j] ^ given[j]
    return bool(differ == 0)


def _same_bits(kept: npt.NDArray[Any], given: npt.NDArray[Any]) -> bool:
    """Whether two arrays of one shape and dtype hold the same bytes.

    Compared as 64-bit words (:func:`same_words`; one pass, no NaN handling): NaNs
    with the same payload match, and -0.0 does not match 0.0, which only costs a
    recomputation. Falls back to ``np.array_equal`` for other layouts and for a
    size in bytes that is not a multiple of 8.
    """
    if (
        not kept.flags.c_contiguous
        or not given.flags.c_contiguous
        or kept.dtype.kind not in "biuf"
    ):
        return bool(np.array_equal(kept, given, equal_nan=kept.dtype.kind == "f"))
    first = kept.reshape(-1).view(np.uint8)
    second = given.reshape(-1).view(np.uint8)
    if first.size % 8:
        return bool(np.array_equal(first, second))
    return bool(same_words(first.view(np.uint64), second.view(np.uint64)))


def modal_share(votes: IntArray) -> float | None:
    """Mean share of points given each voting part's most common vote.

    Parts that abstain on every point (dead shards) are left out; None when no
    part votes.
    """
    live = [row for row in np.asarray(votes) if np.any(row >= 0)]
    if not live:
        return None
    shares = [np.unique(row, return_counts=True)[1].max() / row.size for row in live]
    return float(np.mean(shares))


def warn_if_degenerate(
    votes: IntArray, labels: IntArray, part_size: float | None
) -> None:
    """Warn (:class:`DegeneratePartsWarning`) when the parts' votes barely vary.

    Degenerate: the :func:`modal_share` on the calibration data is at least
    :data:`DEGENERATE_SHARE` and at least halfway from the largest class's share
    of the labels to 1 (a vote that follows an imbalanced label is no sign).
    ``part_size`` (mean training points per part) goes into the message.
    """
    share = modal_share(votes)
    largest = float(np.bincount(labels).max() / labels.size)
    if share is None or share < max(DEGENERATE_SHARE, (1 + largest) / 2):
        return
    per_part = "" if part_size is None else f", {part_size:.0f} training points a part"
    warnings.warn(
        f"RPS part models look degenerate: on the calibration data each part gives "
        f"its most common vote to {share:.0%} of the points on average (the largest "
        f"class holds {largest:.0%} of the labels), so the votes barely depend on "
        "the input and the sets grow. Likely cause: too many training parts for the "
        f"data (n_train_parts={len(votes)}{per_part}), or a base model too "
        "constrained to learn (strong regularisation); use fewer parts, more "
        "training data or a model that learns from few points",
        DegeneratePartsWarning,
        stacklevel=4,
    )
