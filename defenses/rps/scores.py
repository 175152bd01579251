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

Both have closed forms, evaluated in O(K) per (point, class) for any radius by
compiled loops (:mod:`defenses.rps.kernels`).
Every score is computed by the same formula from (own votes, sorted other votes), so
equal vote vectors give bit-identical scores whatever the class order: ties between
test and calibration scores stay exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import BoolArray, FloatArray, IntArray
from defenses.rps.certificate import TIE, CertifiedArrays
from defenses.rps.entries import (
    count_votes,
    entry_scores,
    point_radii,
    row_others,
    row_scores,
    vote_rows,
)
from defenses.rps.kernels import bounds, certified_radii

if TYPE_CHECKING:
    from defenses.rps.certificate import PartThresholds


ABSTAIN = -1
"""A part's prediction when it votes for no class."""


def vote_counts(
    predictions: npt.ArrayLike, n_classes: int, abstain: bool = False
) -> IntArray:
    """Votes per class, shape (n, K), from part predictions of shape (k_t, n).

    With ``abstain=True`` a prediction may be :data:`ABSTAIN` (-1): it counts for no
    class, so a row sums to ``k_t`` minus the abstentions.
    """
    p = np.ascontiguousarray(predictions, dtype=np.int64)
    if p.ndim != 2:
        raise ValueError(f"predictions must have shape (k_t, n), got {p.shape}")
    low = ABSTAIN if abstain else 0
    counts = count_votes(p, n_classes, low)
    if counts.size and counts[0, 0] < 0:
        raise ValueError(
            f"predictions must lie in [{low}, {n_classes}), got [{p.min()}, {p.max()}]"
        )
    return counts


_FIELDS: tuple[str, ...] = ("rows", "start", "own", "index", "scores", "n_voters")
_FIELDS += ("softmax", "tails", "_others")  # VoteGeometry's, in _fill's order


def _table(n_voters: int) -> FloatArray:
    """``table[v]`` = :math:`e^{v / k_t}` for ``v`` in ``0..k_t + 1``."""
    return np.exp(np.arange(n_voters + 2, dtype=np.float64) / n_voters)


class VoteGeometry:
    """Score bounds of a batch, per *entry*: a point and one of its vote counts.

    Classes of a point with equal votes have equal scores and bounds, and so have
    points with the same sorted vote vector, so the work is done once per entry: a
    distinct sorted vote vector (a *row*) and one of its distinct vote counts;
    ``index`` maps each (point, class) to its entry. :meth:`lower` and
    :meth:`upper` take a radius that broadcasts against the entries (optionally
    restricted to ``rows``). Immutable.

    Built by hand from entries (each its own row), or from the sorted rows of a
    batch by :func:`vote_geometry`, which writes no ``others``: an entry's others
    are its row without one ``own``, copied out by the kernels when needed and by
    the ``others`` property on first access.

    Attributes
    ----------
    own : ndarray of shape (E,)
        The entry's vote count.
    others : ndarray of shape (E, K - 1)
        The point's other votes, sorted descending.
    rows, start : ndarrays of shape (R, K) and (R + 1,)
        The distinct sorted vote vectors (descending); the entries of row ``r``
        are ``start[r]`` to ``start[r + 1] - 1``, its distinct counts descending.
    index : ndarray of shape (n, K)
        Entry of each (point, class).
    scores : ndarray of shape (E,)
        The smoothed scores (computed by :func:`smoothed_scores`).
    tails : ndarray of shape (E,)
        The canonical sum of the others' terms but the largest (computed when
        None is given; unused for raw fractions).
    """

    own: IntArray
    rows: IntArray
    start: IntArray
    index: IntArray
    scores: FloatArray
    n_voters: int
    softmax: bool
    tails: FloatArray

    def __init__(
        self,
        own: IntArray,
        others: IntArray,
        index: IntArray,
        scores: FloatArray,
        n_voters: int,
        softmax: bool,
        tails: FloatArray | None = None,
    ) -> None:
        own = np.ascontiguousarray(own, dtype=np.int64)
        others = np.ascontiguousarray(others, dtype=np.int64)
        size, m = others.shape
        # each entry's row: own before the first other below it
        at = (others > own[:, None]).sum(axis=1)[:, None]
        column = np.arange(m + 1)[None, :]
        padded = np.concatenate([others, own[:, None]], axis=1)
        rows = np.take_along_axis(padded, column - (column > at), axis=1)
        rows[np.arange(size), at[:, 0]] = own
        table = _table(n_voters)
        if tails is None:
            tails = np.empty(size)
            entry_scores(own, others, table, np.empty(size), tails)
        start = np.arange(size + 1)
        self._fill(rows, start, own, index, scores, n_voters, softmax, tails, others)

    @classmethod
    def of_rows(
        cls,
        rows: IntArray,
        start: IntArray,
        own: IntArray,
        index: IntArray,
        scores: FloatArray,
        n_voters: int,
        softmax: bool,
        tails: FloatArray,
    ) -> VoteGeometry:
        """The geometry of sorted rows (:func:`defenses.rps.entries.vote_rows`)."""
        geometry = cls.__new__(cls)
        geometry._fill(rows, start, own, index, scores, n_voters, softmax, tails, None)
        return geometry

    def _fill(self, *values: Any) -> None:
        for name, value in zip(_FIELDS, values, strict=True):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_table", _table(self.n_voters))

    def __setattr__(self, name: str, value: Any) -> None:
        """Refused: a geometry is shared (the votes memo hands it to later calls)."""
        raise AttributeError(f"VoteGeometry is immutable: cannot set {name!r}")

    @property
    def others(self) -> IntArray:
        """Each entry's other votes, sorted descending (copied out once)."""
        if self.__dict__["_others"] is None:
            others = row_others(self.rows, self.start, self.own)
            object.__setattr__(self, "_others", others)
        return np.asarray(self.__dict__["_others"])

    @property
    def size(self) -> int:
        """Number of entries."""
        return int(self.own.shape[0])

    def score(self) -> FloatArray:
        """The smoothed score of each entry."""
        return self.scores

    def _bounds(
        self, radius: npt.ArrayLike, rows: IntArray | None, upper: bool
    ) -> FloatArray:
        chosen = np.arange(self.size) if rows is None else np.asarray(rows, np.int64)
        chosen = np.ascontiguousarray(chosen)
        r = np.asarray(radius, dtype=np.int64)
        if np.any(r < 0):
            raise ValueError("radius must be >= 0")
        out = np.empty(chosen.shape[0])
        bounds(
            self.rows,
            self.start,
            self.own,
            chosen,
            np.ascontiguousarray(np.broadcast_to(r, chosen.shape)),
            self.n_voters,
            self.__dict__["_table"],
            self.softmax,
            upper,
            out,
        )
        return out

    def upper(self, radius: npt.ArrayLike, rows: IntArray | None = None) -> FloatArray:
        """Largest score after ``radius`` changed votes."""
        return self._bounds(radius, rows, True)

    def lower(self, radius: npt.ArrayLike, rows: IntArray | None = None) -> FloatArray:
        """Smallest score after ``radius`` changed votes."""
        return self._bounds(radius, rows, False)

    def _searches(
        self,
        thresholds: PartThresholds,
        in_set: BoolArray,
        ceiling: IntArray,
        limit: IntArray,
        calibrate: bool = False,
    ) -> tuple[IntArray, IntArray]:
        """:func:`defenses.rps.kernels.certified_radii`: training and joint radii.

        With ``calibrate``, ``limit`` is overwritten with the calibration radii.
        """
        training = np.empty(self.size, dtype=np.int64)
        joint = np.empty(self.size, dtype=np.int64)
        certified_radii(
            self.rows,
            self.start,
            self.own,
            self.scores,
            self.tails,
            np.ascontiguousarray(in_set),
            np.ascontiguousarray(ceiling, dtype=np.int64),
            limit if calibrate else np.ascontiguousarray(limit, dtype=np.int64),
            calibrate,
            self.n_voters,
            self.__dict__["_table"],
            self.softmax,
            np.ascontiguousarray(thresholds.lower),
            np.ascontiguousarray(thresholds.upper),
            thresholds.tau_hat,
            thresholds.guard,
            TIE,
            training,
            joint,
        )
        return training, joint

    def largest(
        self,
        thresholds: PartThresholds,
        in_set: BoolArray,
        joint: bool,
        ceiling: IntArray | None = None,
    ) -> IntArray:
        """Largest r_t certified per entry with r_c = 0 (or with r_c = r_t).

        The largest radius at which :meth:`PartThresholds.certified` holds (it is
        monotone in both radii; radius 0 always counts), at most
        ``thresholds.radius`` and ``ceiling`` (a known bound per entry).
        """
        top = np.full(self.size, thresholds.radius, dtype=np.int64)
        if ceiling is not None:
            np.minimum(top, ceiling, out=top)
        training, both = self._searches(thresholds, in_set, top, top)
        return both if joint else training

    def radii(
        self, thresholds: PartThresholds, in_set: BoolArray, calibration: IntArray
    ) -> tuple[IntArray, IntArray]:
        """Training and joint radii per entry (the joint one below ``calibration``).

        ``largest(joint=False)`` and ``largest(joint=True)`` in one pass
        (:func:`defenses.rps.kernels.certified_radii`).
        """
        top = np.full(self.size, thresholds.radius, dtype=np.int64)
        return self._searches(thresholds, in_set, top, calibration)

    def certify_arrays(self, thresholds: PartThresholds) -> CertifiedArrays:
        """Membership and radii (``ScoreGeometry.certify_arrays``).

        The calibration radius (:meth:`PartThresholds.calibration_radius` at
        :math:`r_t = 0`), then :meth:`radii` below it, in one pass
        (:func:`defenses.rps.kernels.certified_radii`), gathered per (point, class).
        """
        in_set = np.asarray(self.scores >= thresholds.cut)
        calibration = np.empty(self.size, dtype=np.int64)
        top = np.full(self.size, thresholds.radius, dtype=np.int64)
        training, joint = self._searches(thresholds, in_set, top, calibration, True)
        index = np.ascontiguousarray(self.index, dtype=np.int64)
        return CertifiedArrays(
            in_set, *point_radii(index, in_set, training, calibration, joint)
        )


def _check_votes(votes: npt.ArrayLike, n_voters: int, abstain: bool) -> IntArray:
    v = np.ascontiguousarray(votes, dtype=np.int64)
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

    The sets compare scores with thresholds exactly, which decides a tie correctly
    only if scores that are *mathematically* equal are also equal in floating
    point. Without abstentions every row sums to ``k_t``, so equal scores
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

    The other classes' terms are summed smallest first (:func:`canonical_scores`),
    so the score is a bit-exact function of (own votes, multiset of the others'
    votes), equal to the bounds that reach that vote vector. ``abstain=True``
    accepts rows that sum to less than ``n_voters`` (abstaining parts count for no
    class); see :func:`_tie_exact` for why those rows are shifted first.
    """
    v = _check_votes(votes, n_voters, abstain)
    if not softmax:
        return np.asarray(v / n_voters, dtype=np.float64)
    geometry = vote_geometry(v, n_voters, softmax=True, abstain=abstain)
    return np.asarray(geometry.scores[geometry.index], dtype=np.float64)


def vote_geometry(
    votes: npt.ArrayLike, n_voters: int, softmax: bool = True, abstain: bool = False
) -> VoteGeometry:
    """Entries (distinct sorted vote vector, distinct vote count), shared by points.

    Scores and bounds depend on a class's votes and the multiset of the others
    only, so points with the same sorted vote vector share their entries
    (:func:`defenses.rps.entries.vote_rows`).
    ``abstain=True`` accepts rows summing to less than ``n_voters``; the bounds
    then cover moves into and out of the abstain state.
    """
    v = _check_votes(votes, n_voters, abstain)
    return counted_geometry(v, n_voters, softmax, abstain)


def counted_geometry(
    votes: IntArray, n_voters: int, softmax: bool, abstain: bool
) -> VoteGeometry:
    """:func:`vote_geometry` of votes known to be valid (from :func:`vote_counts`).

    ``votes`` is a C-contiguous int64 (n, K) array, K >= 2, whose rows sum to
    ``n_voters`` (at most, with ``abstain``).
    """
    table = _table(n_voters)
    rows, start, own, index, scores, tails = vote_rows(votes, table)
    if not softmax:  # raw fractions use no sums
        tails = np.zeros(own.shape[0])
        scores = np.asarray(own / n_voters, dtype=np.float64)
    elif abstain:  # scores of the rows minus their smallest count (_tie_exact)
        row_scores(rows, start, own, table, True, scores, np.empty(0))
    return VoteGeometry.of_rows(
        rows, start, own, index, scores, n_voters, softmax, tails
    )


def canonical_scores(
    own: IntArray, others: IntArray, n_voters: int, abstain: bool = False
) -> FloatArray:
    r"""Softmax scores of entries, summed in the canonical order of the kernels.

    :math:`s = m / (m + \text{rest})` with :math:`m = e^{v_y / k_t}` and rest the
    other classes' :math:`e^{v_c / k_t}` added smallest first (the bounds'
    radius-0 value, :func:`defenses.rps.kernels.upper_bound`), so a score equals
    bit for bit every bound that reaches its vote vector. With abstentions the
    entry is first shifted by its smallest vote (:func:`_tie_exact`).
    """
    if abstain:
        low = np.minimum(own, others.min(axis=1))
        own = own - low
        others = others - low[:, None]
    own = np.ascontiguousarray(own, dtype=np.int64)
    others = np.ascontiguousarray(others, dtype=np.int64)
    table = _table(n_voters)
    out = np.empty(own.shape[0])
    entry_scores(own, others, table, out, np.empty(own.shape[0]))
    return out
