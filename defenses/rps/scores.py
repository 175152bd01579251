r"""Vote scores of the partitioned ensemble and their worst case under poisoning.

With :math:`k_t` part classifiers :math:`f^{(i)}`, the vote counts are
:math:`v_y(x) = \#\{i : f^{(i)}(x) = y\}`, the fractions :math:`\pi_y = v_y / k_t`
and the smoothed score is :math:`s(x, y) = e^{\pi_y} / \sum_c e^{\pi_c}`
(Scholten & Günnemann, ICLR 2025, Alg. 1); ``softmax=False`` uses
:math:`s = \pi_y`.

A poisoned training point lies in one part, so :math:`r` poisoned points change at
most :math:`r` votes: the reachable vote vectors are those :math:`v'` with
:math:`\sum_c \max(0, v_c - v'_c) \le r`. The extreme scores over that set are
reached greedily, one vote at a time (the tests check this against brute-force
enumeration):

* upper bound of :math:`s(x, y)`: move a vote from the largest other class to
  :math:`y`. After :math:`r' = \min(r, k_t - v_y)` moves the other classes are
  "water-filled" down from the top: with the others sorted,
  :math:`o_1 \ge o_2 \ge \dots`, the top :math:`j` of them end at levels
  :math:`L` or :math:`L + 1` summing to :math:`\sum_{c \le j} o_c - r'`;
* lower bound: move :math:`\min(r, v_y)` votes from :math:`y` to the largest other
  class, then drain the remaining other classes, smallest first, into it.

Parts may also *abstain* (an external ensemble whose part has no model, see
:class:`defenses.rps.ensemble.PartVoter`): then :math:`a = k_t - \sum_c v_c \ge 0`
parts vote for no class, :math:`\pi_c = v_c / k_t` still, and the softmax runs over
the :math:`K` classes only. A changed part may move between any two of the
:math:`K + 1` states (a class or abstain), so the reachable vectors are those
:math:`(v', a')` with :math:`\sum_c \max(0, v_c - v'_c) + \max(0, a - a') \le r`.
Writing :math:`s = e_y / (e_y + R)` with :math:`e_c = e^{\pi_c}` and
:math:`R = \sum_{c \ne y} e_c`:

* upper bound: a vote moved from another class to :math:`y` raises :math:`e_y` and
  lowers :math:`R`, one moved from abstain only raises :math:`e_y`, so other
  classes are drained first (water-filling as above, :math:`\min(r, \sum_{c \ne y}
  v_c)` moves) and then :math:`\min(r - \text{moved}, a)` abstentions join
  :math:`y`; moving a vote *to* abstain is never better than moving it to :math:`y`;
* lower bound: a vote from :math:`y` to the largest other class lowers
  :math:`e_y` and raises :math:`R` by :math:`e^{(t+1)/k_t} - e^{t/k_t}`; one from
  abstain to it raises :math:`R` by the same amount; draining a class of
  :math:`m > 0` votes into it raises :math:`R` by that amount *minus*
  :math:`e^{m/k_t} - e^{(m-1)/k_t}`; moving to abstain only lowers terms. So the
  order is: :math:`\min(r, v_y)` votes from :math:`y`, then :math:`\min(\cdot, a)`
  abstentions, then the drain, all into the largest other class.

With :math:`a = 0` these are the bounds above, bit for bit. ``softmax=False`` gives
:math:`v_y \pm` the moves, capped at :math:`k_t` and 0.

Both have closed forms, evaluated here in O(K) per (point, class) for any radius.
Every score is computed by the same formula from (own votes, sorted other votes), so
equal vote vectors give bit-identical scores whatever the class order: ties between
test and calibration scores stay exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
ScalarT = TypeVar("ScalarT", bound=np.generic)


ABSTAIN = -1
"""A part's prediction when it votes for no class."""


def vote_counts(
    predictions: npt.ArrayLike, n_classes: int, abstain: bool = False
) -> IntArray:
    """Votes per class, shape (n, K), from part predictions of shape (k_t, n).

    With ``abstain=True`` a prediction may be :data:`ABSTAIN` (-1): it counts for no
    class, so a row sums to ``k_t`` minus the abstentions.
    """
    p = np.asarray(predictions, dtype=np.int64)
    if p.ndim != 2:
        raise ValueError(f"predictions must have shape (k_t, n), got {p.shape}")
    low = ABSTAIN if abstain else 0
    if p.size and (p.min() < low or p.max() >= n_classes):
        raise ValueError(
            f"predictions must lie in [{low}, {n_classes}), got [{p.min()}, {p.max()}]"
        )
    n = p.shape[1]
    width = n_classes + 1 if abstain else n_classes
    flat = p + (width * np.arange(n, dtype=np.int64) + (1 if abstain else 0))[None, :]
    counts = np.bincount(flat.ravel(), minlength=n * width).reshape(n, width)
    return np.ascontiguousarray(counts[:, 1:] if abstain else counts, dtype=np.int64)


@dataclass(frozen=True)
class VoteGeometry:
    """Score bounds of a batch, per *entry*: a point and one of its vote counts.

    Classes of a point with equal votes have equal scores and bounds, and so have
    points with the same sorted vote vector, so the work is done once per entry: a
    distinct sorted vote vector and one of its distinct vote counts; ``index``
    maps each (point, class) to its entry. :meth:`lower` and :meth:`upper` take a
    radius that broadcasts against the entries (optionally restricted to ``rows``).

    Attributes
    ----------
    own : ndarray of shape (E,)
        The entry's vote count.
    others : ndarray of shape (E, K - 1)
        The point's other votes, sorted descending.
    index : ndarray of shape (n, K)
        Entry of each (point, class).
    scores : ndarray of shape (E,)
        The smoothed scores (computed by :func:`smoothed_scores`).
    """

    own: IntArray
    others: IntArray
    index: IntArray
    scores: FloatArray
    n_voters: int
    softmax: bool

    def __post_init__(self) -> None:
        table = np.exp(np.arange(self.n_voters + 2, dtype=np.float64) / self.n_voters)
        object.__setattr__(self, "_table", table)
        # Tables are kept column by column, shape (columns, E): each is built with
        # whole-column operations, one cell per entry is a 1-d ``take`` of the
        # flattened table (several times cheaper than 2-d fancy indexing), and a
        # per-entry count walks the columns, stopping once every entry has.
        o = np.ascontiguousarray(self.others.T)
        m, e = o.shape
        top_sum = _running_sum(o)
        ascending = o[:0:-1]
        cum = _running_sum(ascending)
        room = top_sum[-1]
        zeros = np.zeros((1, e), dtype=np.int64)
        derived = {
            "room": room,
            "abstain": self.n_voters - self.own - room,
            "first_other": o[0],
            "top_sum": top_sum.ravel(),
            "depth_columns": top_sum - np.arange(1, m + 1)[:, None] * o,
            "tail": _suffix_sums(self._exp(o)).ravel(),
            "drainable": cum[-1] if m > 1 else zeros[0],
            "cum_columns": cum,
            "zero_classes": np.count_nonzero(ascending == 0, axis=0),
            "before": np.concatenate([zeros, cum]).ravel(),
            "padded": np.concatenate([ascending, zeros]).ravel(),
            "suffix": _suffix_sums(self._exp(ascending)).ravel(),
        }
        object.__setattr__(self, "_derived", derived)

    def _count_at_most(
        self, name: str, values: IntArray, rows: IntArray, start: int
    ) -> IntArray:
        """Per row of the ascending table ``name``: how many cells are <= value.

        The first ``start`` cells are known to be <= value.
        """
        columns: IntArray = self.__dict__["_derived"][f"{name}_columns"]
        count = np.full(rows.shape[0], start, dtype=np.int64)
        active = np.arange(rows.shape[0])
        for column in columns[start:]:
            below = column.take(rows[active]) <= values[active]
            active = active[below]
            if not active.size:
                break
            count[active] += 1
        return count

    def _get(self, name: str, rows: IntArray | None) -> npt.NDArray[np.generic]:
        derived: dict[str, npt.NDArray[np.generic]] = self.__dict__["_derived"]
        values = derived[name]
        return values if rows is None else values.take(rows)

    def _cell(self, name: str, rows: IntArray, column: IntArray) -> FloatArray:
        """Cell ``column`` of each entry in ``rows`` of a flattened table."""
        derived: dict[str, npt.NDArray[np.generic]] = self.__dict__["_derived"]
        return np.asarray(derived[name].take(column * self.size + rows))

    @property
    def size(self) -> int:
        """Number of entries."""
        return int(self.own.shape[0])

    def _exp(self, votes: npt.ArrayLike) -> FloatArray:
        table: FloatArray = self.__dict__["_table"]
        return np.asarray(table.take(np.asarray(votes, dtype=np.int64)))

    def _score(self, own: IntArray, rest: FloatArray | None) -> FloatArray:
        if rest is None:
            return np.asarray(own / self.n_voters, dtype=np.float64)
        e = self._exp(own)
        return np.asarray(e / (e + rest), dtype=np.float64)

    def _radius(self, radius: npt.ArrayLike, rows: IntArray | None) -> IntArray:
        r = np.asarray(radius, dtype=np.int64)
        if np.any(r < 0):
            raise ValueError("radius must be >= 0")
        n = self.size if rows is None else int(rows.shape[0])
        return np.broadcast_to(r, (n,))

    def score(self) -> FloatArray:
        """The smoothed score of each entry."""
        return self.scores

    def upper(self, radius: npt.ArrayLike, rows: IntArray | None = None) -> FloatArray:
        """Largest score after ``radius`` changed votes."""
        r = self._radius(radius, rows)
        own_votes = self.own if rows is None else self.own.take(rows)
        moved = np.minimum(r, self._get("room", rows))
        own = own_votes + np.minimum(r, self.n_voters - own_votes)
        if not self.softmax:
            return self._score(own, None)
        at = np.arange(moved.shape[0]) if rows is None else rows
        j = self._count_at_most("depth", moved, at, 1)
        top = self._cell("top_sum", at, j - 1)
        kept = top - moved
        level = kept // j
        high = kept - j * level
        tail = self._cell("tail", at, j)
        rest = (j - high) * self._exp(level) + high * self._exp(level + 1) + tail
        return self._score(own, rest)

    def lower(self, radius: npt.ArrayLike, rows: IntArray | None = None) -> FloatArray:
        """Smallest score after ``radius`` changed votes."""
        r = self._radius(radius, rows)
        own_votes = self.own if rows is None else self.own.take(rows)
        first = np.minimum(r, own_votes)
        own = own_votes - first
        if not self.softmax:
            return self._score(own, None)
        joined = np.minimum(r - first, self._get("abstain", rows))
        drained = np.minimum(r - first - joined, self._get("drainable", rows))
        at = np.arange(r.shape[0]) if rows is None else rows
        top = self._get("first_other", at) + first + joined + drained
        m = self.others.shape[-1] - 1
        # Classes drained completely: with nothing drained, the empty ones.
        t = np.asarray(self._get("zero_classes", at), dtype=np.int64)
        draining = np.flatnonzero(drained > 0)
        if draining.size:
            t[draining] = self._count_at_most("cum", drained[draining], at[draining], 0)
        before = self._cell("before", at, t)
        partial = self._cell("padded", at, t) - (drained - before)
        after = self._cell("suffix", at, np.minimum(t + 1, m))
        intact = t < m
        rest = (
            self._exp(top)
            + t.astype(np.float64)
            + np.where(intact, self._exp(partial) + after, 0.0)
        )
        return self._score(own, rest)


def _running_sum(rows: npt.NDArray[ScalarT]) -> npt.NDArray[ScalarT]:
    """Cumulative sums down the rows: row ``c`` is the sum of rows ``0..c``.

    The same additions in the same order as ``np.cumsum(rows, axis=0)``, one whole
    row at a time (a few times faster for these short, wide tables).
    """
    out = np.empty_like(rows)
    if rows.shape[0]:
        out[0] = rows[0]
    for c in range(1, rows.shape[0]):
        np.add(out[c - 1], rows[c], out=out[c])
    return out


def _suffix_sums(columns: FloatArray) -> FloatArray:
    """Row ``c`` of the result: the sum of rows ``c..`` of ``columns`` (last: 0)."""
    out = np.zeros((columns.shape[0] + 1, columns.shape[1]), dtype=np.float64)
    out[-2::-1] = _running_sum(columns[::-1])
    return out


def _check_votes(votes: npt.ArrayLike, n_voters: int, abstain: bool) -> IntArray:
    v = np.asarray(votes, dtype=np.int64)
    if v.ndim != 2 or v.shape[1] < 2:
        raise ValueError(f"votes must have shape (n, K) with K >= 2, got {v.shape}")
    if n_voters < 1:
        raise ValueError(f"n_voters must be >= 1, got {n_voters}")
    total = v.sum(axis=1)
    if abstain:
        if v.size and (v.min() < 0 or np.any(total > n_voters)):
            raise ValueError(
                f"votes must be >= 0 and each row must sum to at most "
                f"n_voters={n_voters}"
            )
    elif np.any(total != n_voters) or (v.size and v.min() < 0):
        raise ValueError(f"each row of votes must sum to n_voters={n_voters}")
    return v


def _tie_exact(votes: IntArray) -> IntArray:
    """Votes shifted so that their smallest class has none (the softmax is unchanged).

    The certificate treats a bound within ``TIE`` of a threshold as reaching it,
    which is sound only if scores that are *mathematically* equal are also equal in
    floating point. Without abstentions every row sums to ``k_t``, so equal scores
    come from equal vote multisets and are bit-identical. With abstentions, rows
    that differ by a constant, e.g. (2, 1) and (1, 0) of 3 parts, have the same
    softmax computed along different roundings; a score could then miss a
    threshold it equals by one ulp. Since :math:`e^{a / k_t}` is transcendental,
    two rows have equal scores exactly when they are such shifts of each other, so
    subtracting the row minimum makes every tie bit-exact.
    """
    return np.asarray(votes - votes.min(axis=1, keepdims=True), dtype=np.int64)


def smoothed_scores(
    votes: npt.ArrayLike, n_voters: int, softmax: bool = True, abstain: bool = False
) -> FloatArray:
    """Scores s(x, y) of shape (n, K) from vote counts.

    The softmax denominator is summed over the votes in sorted order, so the score
    is a bit-exact function of (own votes, multiset of votes): equal vote vectors
    give equal scores whatever the class order. ``abstain=True`` accepts rows that
    sum to less than ``n_voters`` (abstaining parts count for no class); see
    :func:`_tie_exact` for why those rows are shifted first.
    """
    v = _check_votes(votes, n_voters, abstain)
    if not softmax:
        return np.asarray(v / n_voters, dtype=np.float64)
    if abstain:
        v = _tie_exact(v)
    fractions = v / n_voters
    ordered = -np.sort(-v, axis=1)
    denominator = np.exp(ordered / n_voters).sum(axis=1, keepdims=True)
    return np.asarray(np.exp(fractions) / denominator, dtype=np.float64)


def vote_geometry(
    votes: npt.ArrayLike, n_voters: int, softmax: bool = True, abstain: bool = False
) -> VoteGeometry:
    """Entries (distinct sorted vote vector, distinct vote count), shared by points.

    Scores and bounds depend on a class's votes and the multiset of the others
    only, so points with the same sorted vote vector share their entries (the
    vectors are keyed by one integer when it fits in 62 bits).
    ``abstain=True`` accepts rows summing to less than ``n_voters``; the bounds
    then cover moves into and out of the abstain state.
    """
    v = _check_votes(votes, n_voters, abstain)
    n, k = v.shape
    order = np.argsort(-v, axis=1, kind="stable")
    ordered = np.take_along_axis(v, order, axis=1)
    first = np.ones((n, k), dtype=bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    rows, inverse = _distinct_rows(ordered, n_voters)
    row_first = first[rows]
    point, position = np.nonzero(row_first)
    # Column c of the others: the sorted votes without the entry's own position.
    flat = ordered[rows].ravel()
    base = point * k
    others = np.empty((k - 1, point.size), dtype=np.int64)
    for c in range(k - 1):
        others[c] = flat.take(base + c + (position <= c))
    rank = np.cumsum(first, axis=1) - 1
    sorted_rank = np.empty_like(order)
    np.put_along_axis(sorted_rank, order, np.arange(k)[None, :], axis=1)
    start = np.concatenate([[0], np.cumsum(row_first.sum(axis=1))[:-1]])
    index = start[inverse][:, None] + np.take_along_axis(rank, sorted_rank, axis=1)
    own = flat.take(base + position)
    if softmax:
        distinct = ordered[rows]
        shifted = _tie_exact(distinct) if abstain else distinct
        denominator = np.exp(shifted / n_voters).sum(axis=1)
        entry_scores = np.exp(shifted[point, position] / n_voters) / denominator[point]
    else:
        entry_scores = own / n_voters
    return VoteGeometry(
        own,
        others.T,
        index.astype(np.int64),
        np.asarray(entry_scores, dtype=np.float64),
        n_voters,
        softmax,
    )


def _distinct_rows(ordered: IntArray, n_voters: int) -> tuple[IntArray, IntArray]:
    """One representative row per distinct sorted vote vector, and each row's.

    Returns ``(rows, inverse)`` with ``ordered[rows[inverse]] == ordered``. A vote
    vector is keyed by its digits in base ``n_voters + 1``; when the key could
    overflow, every row stands for itself.
    """
    n, k = ordered.shape
    if k * math.log2(n_voters + 1) >= 62:
        identity = np.arange(n, dtype=np.int64)
        return identity, identity
    weights = (n_voters + 1) ** np.arange(k - 1, -1, -1, dtype=np.int64)
    keys = ordered @ weights
    _, rows, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return rows.astype(np.int64), inverse.astype(np.int64).ravel()
