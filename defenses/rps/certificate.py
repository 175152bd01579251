r"""Reliability certificates of RPS prediction sets (counting arguments).

Scholten & Günnemann (ICLR 2025). A poisoned training point (insertion, deletion or
label flip) lies in one training part, so ``r_t`` of them change at most ``r_t``
votes; a poisoned calibration point lies in one calibration part, so ``r_c`` of
them change at most ``r_c`` part sets :math:`C_i` (arbitrarily). A feature
modification can move a point between parts and counts as two.

For each calibration part :math:`i` and training radius :math:`r_t`, the poisoned
threshold lies in :math:`[\tau_i^{lo}(r_t), \tau_i^{up}(r_t)]`: the :math:`j_i`-th
smallest of the calibration points' lower (upper) score bounds, since order
statistics are monotone. For a test point and class :math:`y`:

* :math:`g_y(r_t) = \#\{i : \underline{s}_y(r_t) \ge \tau_i^{up}(r_t)\}` parts surely
  keep y, :math:`o_y(r_t) = \#\{i : \overline{s}_y(r_t) < \tau_i^{lo}(r_t)\}` parts
  surely leave it out;
* y in the set stays in (inclusion certificate, coverage reliability) while
  :math:`g_y - r_c > \hat\tau`, i.e. up to :math:`r_c = g_y - \hat\tau - 1`;
* y out of the set stays out (exclusion certificate, size reliability) while
  :math:`k_c - o_y + r_c \le \hat\tau`, i.e. up to
  :math:`r_c = \hat\tau - k_c + o_y`;
* and a part must keep enough points for its rank after :math:`r_c` deletions:
  :math:`r_c \le \min_i n_i - n_{\min}` (the official code's guard).

Every class is checked (the official code checks only the extreme ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from defenses.arrays import BoolArray, FloatArray, IntArray
from defenses.checks import check_int
from defenses.rps.kernels import calibration_radii

TIE = 1e-10
"""A class out of the set is certified to stay out only if its score bound is below
the threshold bound by more than this.

Every comparison of the certificate leans to the safe side: a class in the set is
kept by a part only when its lower score bound reaches the part's upper threshold
bound *exactly* (``low >= cut``, no tolerance), and a class out of it is surely
left out only when its upper bound lies more than ``TIE`` below the lower
threshold bound (``high < cut - TIE``). A tolerance can therefore only shrink a
radius, never grow one. Exact ties between a bound and a threshold are common
(vote scores are discrete), and bounds are computed along other paths than the
scores: a tie computed one ulp off may lose a certificate on the inclusion side
(the kernels compute both from one canonical sum, so equal vote vectors give
equal bits), and on the exclusion side ``TIE`` keeps a tie that rounding puts an
ulp below the threshold from being certified as out. Distinct vote scores may lie
as close as 2.4e-11 (Issue 39); that only costs exclusion certificates.
"""


class ScoreGeometry(Protocol):
    """Scores of a batch per entry, and their bounds after ``r`` changed votes.

    ``index`` (n, K) maps each (point, class) to its entry; bounds take an optional
    ``rows`` selection of entries.
    """

    @property
    def index(self) -> IntArray:
        """Entry of each (point, class)."""
        ...

    @property
    def size(self) -> int:
        """Number of entries."""
        ...

    def score(self) -> FloatArray:
        """s(x, y) per entry."""
        ...

    def lower(self, radius: npt.ArrayLike, rows: IntArray | None = None) -> FloatArray:
        """Smallest reachable score."""
        ...

    def upper(self, radius: npt.ArrayLike, rows: IntArray | None = None) -> FloatArray:
        """Largest reachable score."""
        ...

    def certify_arrays(self, thresholds: PartThresholds) -> CertifiedArrays:
        """Membership per entry and the batch's sets and radii per (point, class).

        The training radius is the largest :math:`r_t` at which
        :meth:`PartThresholds.certified` holds with :math:`r_c = 0` (certification
        is monotone in both radii; radius 0 always counts), at most
        ``thresholds.radius``; the calibration radius that of
        :meth:`PartThresholds.calibration_radius` at :math:`r_t = 0`; the joint
        radius the largest :math:`r` certified at :math:`r_t = r_c = r`.
        """
        ...


class CertifiedArrays(NamedTuple):
    """What :meth:`ScoreGeometry.certify_arrays` computes for a batch."""

    in_set: BoolArray
    sets: BoolArray
    training: IntArray
    calibration: IntArray
    joint: IntArray


@dataclass(frozen=True)
class ProbaGeometry:
    """A single model's scores: any change of its training data may change them.

    With one training part a single poisoned point can retrain the only model
    arbitrarily, so the bounds are the trivial [0, 1] for any radius >= 1. Entries
    are the (point, class) pairs.
    """

    scores: FloatArray

    @property
    def index(self) -> IntArray:
        """(point, class) -> row-major entry."""
        n, k = self.scores.shape
        return np.arange(n * k, dtype=np.int64).reshape(n, k)

    @property
    def size(self) -> int:
        """N K."""
        return int(self.scores.size)

    def score(self) -> FloatArray:
        """The model's probabilities, flattened."""
        return np.asarray(self.scores.ravel(), dtype=np.float64)

    def _at(
        self, radius: npt.ArrayLike, rows: IntArray | None, far: float
    ) -> FloatArray:
        s = self.score() if rows is None else self.score()[rows]
        return np.where(np.asarray(radius) == 0, s, far)

    def lower(self, radius: npt.ArrayLike, rows: IntArray | None = None) -> FloatArray:
        """The score at radius 0, else 0."""
        return self._at(radius, rows, 0.0)

    def upper(self, radius: npt.ArrayLike, rows: IntArray | None = None) -> FloatArray:
        """The score at radius 0, else 1."""
        return self._at(radius, rows, 1.0)

    def certify_arrays(self, thresholds: PartThresholds) -> CertifiedArrays:
        """Training and joint radii 0 everywhere: nothing beyond radius 0.

        From radius 1 on the bounds are [0, 1]: a lower bound 0 reaches no upper
        threshold bound above 0, an upper bound 1 is below no threshold bound.
        """
        in_set = np.asarray(self.score() >= thresholds.cut)
        calibration = thresholds.calibration_radius(self, in_set, 0)
        zeros = np.zeros(self.scores.shape, dtype=np.int64)
        return CertifiedArrays(
            in_set, in_set[self.index], zeros, calibration[self.index], zeros.copy()
        )


@dataclass(frozen=True)
class PartThresholds:
    """Sorted per-part threshold bounds after 0..R poisoned training points.

    Attributes
    ----------
    lower, upper : ndarray of shape (k_c, R + 1)
        Threshold bounds, each column sorted ascending over the parts (column 0:
        the thresholds themselves).
    tau_hat : int
        Majority threshold.
    guard : int
        Largest calibration radius the part sizes allow.
    """

    lower: FloatArray
    upper: FloatArray
    tau_hat: int
    guard: int

    @property
    def n_parts(self) -> int:
        """k_c."""
        return int(self.lower.shape[0])

    @property
    def radius(self) -> int:
        """Largest training radius covered."""
        return int(self.lower.shape[1] - 1)

    @property
    def cut(self) -> float:
        r"""The majority set is :math:`\{y : s(x, y) \ge \mathrm{cut}\}`.

        A class is in more than :math:`\hat\tau` part sets exactly when its score
        reaches the :math:`(\hat\tau + 1)`-th smallest part threshold.
        """
        return float(self.lower[self.tau_hat, 0])

    def truncated(self, radius: int) -> PartThresholds:
        """The bounds up to training radius ``radius``."""
        return PartThresholds(
            self.lower[:, : radius + 1],
            self.upper[:, : radius + 1],
            self.tau_hat,
            self.guard,
        )

    def certified(
        self,
        geometry: ScoreGeometry,
        in_set: BoolArray,
        train_radius: npt.ArrayLike,
        calib_radius: npt.ArrayLike,
        rows: IntArray | None = None,
    ) -> BoolArray:
        r"""Whether each entry (or ``rows``) keeps its membership at (r_t, r_c).

        In the set: at least :math:`\hat\tau + 1 + r_c` parts surely keep it, i.e.
        the lower score bound reaches the :math:`(\hat\tau + r_c + 1)`-th smallest
        upper threshold bound (exactly: ``low >= cut``). Out of it: at least
        :math:`k_c - \hat\tau + r_c` parts surely leave it out, i.e. the upper
        score bound is below the :math:`(\hat\tau - r_c + 1)`-th smallest lower
        threshold bound by more than :data:`TIE`. Both lean to the safe side.
        """
        chosen = np.arange(geometry.size) if rows is None else rows
        n = chosen.shape[0]
        r_t = np.broadcast_to(np.asarray(train_radius, dtype=np.int64), (n,))
        r_c = np.broadcast_to(np.asarray(calib_radius, dtype=np.int64), (n,))
        ok = np.zeros(n, dtype=bool)
        allowed = (r_t <= self.radius) & ((r_c == 0) | (r_c <= self.guard))
        member = in_set[chosen]
        keep_at = self.tau_hat + r_c
        drop_at = self.tau_hat - r_c
        pick = np.flatnonzero(allowed & member & (keep_at < self.n_parts))
        if pick.size:
            cut = self.upper[keep_at[pick], r_t[pick]]
            low = geometry.lower(r_t[pick], rows=chosen[pick])
            ok[pick] = low >= cut
        pick = np.flatnonzero(allowed & ~member & (drop_at >= 0))
        if pick.size:
            cut = self.lower[drop_at[pick], r_t[pick]]
            high = geometry.upper(r_t[pick], rows=chosen[pick])
            ok[pick] = high < cut - TIE
        return ok

    def calibration_radius(
        self, geometry: ScoreGeometry, in_set: BoolArray, train_radius: int
    ) -> IntArray:
        """Largest certified r_c per entry at ``train_radius`` (-1: none)."""
        if train_radius > self.radius:
            return np.full(geometry.size, -1, dtype=np.int64)
        out = np.empty(geometry.size, dtype=np.int64)
        if train_radius == 0:  # both bounds are the score itself (bit for bit)
            low = high = np.ascontiguousarray(geometry.score(), dtype=np.float64)
        else:
            low = np.ascontiguousarray(geometry.lower(train_radius), dtype=np.float64)
            high = np.ascontiguousarray(geometry.upper(train_radius), dtype=np.float64)
        calibration_radii(
            low,
            high,
            np.ascontiguousarray(in_set, dtype=np.bool_),
            np.ascontiguousarray(self.lower, dtype=np.float64),
            np.ascontiguousarray(self.upper, dtype=np.float64),
            train_radius,
            self.tau_hat,
            self.guard,
            TIE,
            out,
        )
        return out


@dataclass(frozen=True)
class Certificate:
    """What the prediction sets of a batch provably withstand.

    Attributes
    ----------
    sets : ndarray of shape (n, K)
        The prediction sets.
    training : ndarray of shape (n, K)
        Largest number of poisoned training points (with no calibration poisoning)
        under which each (point, class) keeps its membership; capped at
        ``max_train_radius``.
    calibration : ndarray of shape (n, K)
        Largest number of poisoned calibration points (no training poisoning).
    joint : ndarray of shape (n, K)
        Largest ``r`` such that ``r`` training *and* ``r`` calibration points are
        withstood together.
    max_train_radius : int
        Largest training radius examined.
    geometry, thresholds, in_set
        The per-entry scores and bounds behind the radii (for
        :meth:`calibration_radius` at any training radius).
    """

    sets: BoolArray
    training: IntArray
    calibration: IntArray
    joint: IntArray
    max_train_radius: int
    geometry: ScoreGeometry
    thresholds: PartThresholds
    in_set: BoolArray

    def calibration_radius(self, train_radius: int) -> IntArray:
        """Largest certified calibration radius per (point, class) at ``r_t``.

        -1 where the membership is not certified even with no calibration poisoning.
        """
        train_radius = check_int("train_radius", train_radius, 0)
        if train_radius > self.max_train_radius:
            return np.full(self.sets.shape, -1, dtype=np.int64)
        radius = self.thresholds.calibration_radius(
            self.geometry, self.in_set, train_radius
        )
        return radius[self.geometry.index]

    def certified(self, train_radius: int, calib_radius: int) -> BoolArray:
        """Whether each (point, class) keeps its membership at (r_t, r_c)."""
        train_radius = check_int("train_radius", train_radius, 0)
        calib_radius = check_int("calib_radius", calib_radius, 0)
        calib_radius = min(calib_radius, self.thresholds.guard + 1)  # past the guard
        if train_radius > self.max_train_radius:
            return np.zeros(self.sets.shape, dtype=bool)
        ok = self.thresholds.certified(
            self.geometry, self.in_set, train_radius, calib_radius
        )
        return np.asarray(ok[self.geometry.index])

    def robust(self, train_radius: int, calib_radius: int) -> BoolArray:
        """Points whose whole set is certified (inclusion and exclusion)."""
        return np.asarray(self.certified(train_radius, calib_radius).all(axis=1))

    def coverage_reliable(self, train_radius: int, calib_radius: int) -> BoolArray:
        """Points none of whose set members can be removed (empty sets count)."""
        ok = self.certified(train_radius, calib_radius) | ~self.sets
        return np.asarray(ok.all(axis=1))

    def size_reliable(self, train_radius: int, calib_radius: int) -> BoolArray:
        """Points to whose set no class can be added (full sets count)."""
        ok = self.certified(train_radius, calib_radius) | self.sets
        return np.asarray(ok.all(axis=1))


def certify_batch(
    geometry: ScoreGeometry, thresholds: PartThresholds, radius: int
) -> Certificate:
    """The certificate of a batch up to training radius ``radius``.

    ``radius`` must not exceed ``thresholds.radius``
    (:meth:`ScoreGeometry.certify_arrays`).
    """
    thresholds = thresholds.truncated(radius)
    arrays = geometry.certify_arrays(thresholds)
    return Certificate(
        sets=arrays.sets,
        training=arrays.training,
        calibration=arrays.calibration,
        joint=arrays.joint,
        max_train_radius=radius,
        geometry=geometry,
        thresholds=thresholds,
        in_set=arrays.in_set,
    )
