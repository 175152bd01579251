"""The radius searches of RPS as they were before the one-pass scan (commit 9770ea3).

Plain Python transcriptions of ``defenses/rps/kernels.py`` at that commit: the
per-entry bounds (``lower_bound`` with its O(K) loops, ``upper_bound``) and the
galloping search (probes 1, 2, 4, ... then bisection) of ``largest_radius`` and
``training_and_joint``. The compiled kernels must give the same radii and bounds,
bit for bit (``test_radii_reference.py``). IEEE double arithmetic in Python and in
numba's nopython mode (no fastmath) round every operation alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from defenses.arrays import BoolArray, FloatArray, IntArray

Row = Sequence[int]


def entry_sums(others: Row, table: Sequence[float]) -> tuple[int, list[float]]:
    """Other votes of the entry and ``tail[c]``, added smallest first."""
    m = len(others)
    tail = [0.0] * (m + 1)
    room = 0
    total = 0.0
    for c in range(m - 1, -1, -1):
        room += others[c]
        total += table[others[c]]
        tail[c] = total
    return room, tail


def upper_bound(
    own_votes: int,
    others: Row,
    room: int,
    tail: list[float],
    n_voters: int,
    table: Sequence[float],
    softmax: bool,
    radius: int,
) -> float:
    """Largest score after ``radius`` changed votes (the old kernel's loops)."""
    m = len(others)
    own = own_votes + min(radius, n_voters - own_votes)
    if not softmax:
        return own / n_voters
    moved = min(radius, room)
    top = others[0]
    j = 1
    while j < m and top + others[j] - (j + 1) * others[j] <= moved:
        top += others[j]
        j += 1
    kept = top - moved
    level = kept // j
    high = kept - j * level
    rest = tail[j]
    for _ in range(j - high):
        rest += table[level]
    for _ in range(high):
        rest += table[level + 1]
    mine = table[own]
    return mine / (mine + rest)


def lower_bound(
    own_votes: int,
    others: Row,
    room: int,
    tail: list[float],
    n_voters: int,
    table: Sequence[float],
    softmax: bool,
    radius: int,
) -> float:
    """Smallest score after ``radius`` changed votes (the old kernel's loops)."""
    m = len(others)
    first = min(radius, own_votes)
    own = own_votes - first
    if not softmax:
        return own / n_voters
    drainable = room - others[0]
    joined = min(radius - first, n_voters - own_votes - room)
    drained = min(radius - first - joined, drainable)
    top = others[0] + first + joined + drained
    length = m - 1
    emptied = 0
    before = 0
    if drained == 0:
        while emptied < length and others[m - 1 - emptied] == 0:
            emptied += 1
    else:
        while emptied < length and before + others[m - 1 - emptied] <= drained:
            before += others[m - 1 - emptied]
            emptied += 1
    rest = 0.0
    for _ in range(emptied):
        rest += 1.0
    if emptied < length:
        rest += table[others[m - 1 - emptied] - (drained - before)]
        for c in range(m - 2 - emptied, 0, -1):
            rest += table[others[c]]
    rest += table[top]
    mine = table[own]
    return mine / (mine + rest)


class Tables:
    """The thresholds and constants every probe reads."""

    def __init__(
        self,
        lower: FloatArray,
        upper: FloatArray,
        tau_hat: int,
        guard: int,
        tie: float,
        n_voters: int,
        softmax: bool,
    ) -> None:
        self.lower = lower.tolist()
        self.upper = upper.tolist()
        self.k_c = len(self.lower)
        self.tau_hat = tau_hat
        self.guard = guard
        self.tie = tie
        self.n_voters = n_voters
        self.softmax = softmax
        self.table = np.exp(np.arange(n_voters + 2, dtype=np.float64) / n_voters)
        self.table_list = self.table.tolist()


def certified(
    own_votes: int,
    others: Row,
    room: int,
    tail: list[float],
    member: bool,
    r_t: int,
    r_c: int,
    t: Tables,
) -> bool:
    """The old ``_certified``: kept ``low >= cut``, left out ``high < cut - tie``."""
    if r_c > 0 and r_c > t.guard:
        return False
    args = (own_votes, others, room, tail, t.n_voters, t.table_list, t.softmax, r_t)
    if member:
        keep_at = t.tau_hat + r_c
        if keep_at >= t.k_c:
            return False
        return bool(lower_bound(*args) >= t.upper[keep_at][r_t])
    drop_at = t.tau_hat - r_c
    if drop_at < 0:
        return False
    return bool(upper_bound(*args) < t.lower[drop_at][r_t] - t.tie)


def gallop(
    own_votes: int,
    others: Row,
    member: bool,
    top: int,
    joint: bool,
    t: Tables,
) -> int:
    """Largest certified radius <= ``top``: probes 1, 2, 4, ... then bisection."""
    lo, hi = 0, top + 1
    if hi <= 1:
        return 0
    room, tail = entry_sums(others, t.table_list)
    galloping = True
    while hi - lo > 1:
        probe = min(lo + max(lo, 1), hi - 1) if galloping else (lo + hi) // 2
        r_c = probe if joint else 0
        if certified(own_votes, others, room, tail, member, probe, r_c, t):
            lo = probe
        else:
            hi = probe
            galloping = False
    return lo


def largest_radius(
    own: IntArray,
    others: IntArray,
    in_set: BoolArray,
    ceiling: IntArray,
    joint: bool,
    t: Tables,
) -> IntArray:
    """The old ``largest_radius`` kernel (``ceiling`` already capped)."""
    rows = others.tolist()
    return np.array(
        [
            gallop(int(own[e]), rows[e], bool(in_set[e]), int(ceiling[e]), joint, t)
            for e in range(own.shape[0])
        ],
        dtype=np.int64,
    )


def training_and_joint(
    own: IntArray,
    others: IntArray,
    in_set: BoolArray,
    radius: int,
    calibration: IntArray,
    t: Tables,
) -> tuple[IntArray, IntArray]:
    """The old ``training_and_joint`` kernel: training, then joint below it."""
    rows = others.tolist()
    training = np.zeros(own.shape[0], dtype=np.int64)
    joint = np.zeros(own.shape[0], dtype=np.int64)
    if radius < 1:
        return training, joint
    for e in range(own.shape[0]):
        member = bool(in_set[e])
        training[e] = gallop(int(own[e]), rows[e], member, radius, False, t)
        top = min(int(training[e]), int(calibration[e]))
        joint[e] = gallop(int(own[e]), rows[e], member, top, True, t)
    return training, joint


def bounds_at(
    own: IntArray, others: IntArray, radius: int, upper: bool, t: Tables
) -> FloatArray:
    """The old ``bounds`` kernel at one radius for every entry."""
    bound = upper_bound if upper else lower_bound
    out = np.empty(own.shape[0])
    for e, row in enumerate(others.tolist()):
        room, tail = entry_sums(row, t.table_list)
        out[e] = bound(
            int(own[e]), row, room, tail, t.n_voters, t.table_list, t.softmax, radius
        )
    return out


def calibration_radius(
    scores: FloatArray,
    low: FloatArray,
    high: FloatArray,
    in_set: BoolArray,
    lower: FloatArray,
    upper: FloatArray,
    train_radius: int,
    tau_hat: int,
    guard: int,
    tie: float,
) -> IntArray:
    """The old numpy ``PartThresholds.calibration_radius`` (bounds given whole)."""
    out = np.full(scores.shape[0], -1, dtype=np.int64)
    k_c = lower.shape[0]
    inside = np.flatnonzero(in_set)
    sure_in = np.searchsorted(upper[:, train_radius], low[inside], side="right")
    out[inside] = sure_in - tau_hat - 1
    outside = np.flatnonzero(~in_set)
    not_out = np.searchsorted(lower[:, train_radius], high[outside] + tie, side="right")
    out[outside] = tau_hat - k_c + (k_c - not_out)
    return np.where(out >= 0, np.minimum(out, guard), -1).astype(np.int64)
