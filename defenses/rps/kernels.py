r"""Compiled per-entry bounds and certified radii of the vote scores.

An *entry* (see :class:`defenses.rps.scores.VoteGeometry`) is a class's own vote
count ``own`` and the other classes' votes ``others``, sorted descending
(:math:`o_0 \ge o_1 \ge \dots \ge o_{m-1}`, :math:`m = K - 1`), of
:math:`k_t` parts of which :math:`a = k_t - \text{own} - \sum_c o_c` abstain.
``table[v]`` is :math:`e^{v / k_t}`. The closed forms are those derived in
:mod:`defenses.rps.scores`, evaluated one entry at a time in :math:`O(K)`:

* :func:`upper_bound`: ``r`` votes join the class (from the others first, then from
  the abstaining parts); the others, drained from the top, end at levels
  :math:`L` or :math:`L + 1` over their top :math:`j` classes;
* :func:`lower_bound`: ``r`` votes leave the class, then abstentions join, then the
  smallest others drain, all into the largest other class.

:func:`largest_radius` finds each entry's largest certified training radius by a
galloping search over these bounds against the calibration parts' threshold bounds
(:class:`defenses.rps.certificate.PartThresholds`).
"""

from __future__ import annotations

import numpy as np

from defenses.arrays import BoolArray, FloatArray, IntArray
from defenses.jit import compiled, inlined


@inlined
def _entry_sums(
    others: IntArray, entry: int, table: FloatArray, tail: FloatArray
) -> int:
    r"""Fill ``tail`` for one entry and return the number of other votes.

    ``tail[c]`` is :math:`\sum_{i \ge c} e^{o_i / k_t}`, added from class ``m - 1``
    to ``c`` (``tail[m] = 0``): the smallest first, the canonical order (see
    :func:`upper_bound`).
    """
    m = others.shape[1]
    room = 0
    total = 0.0
    tail[m] = 0.0
    for c in range(m - 1, -1, -1):
        room += others[entry, c]
        total += table[others[entry, c]]
        tail[c] = total
    return room


@inlined
def upper_bound(
    own_votes: int,
    others: IntArray,
    entry: int,
    room: int,
    tail: FloatArray,
    n_voters: int,
    table: FloatArray,
    softmax: bool,
    radius: int,
) -> float:
    """Largest score of the entry after ``radius`` changed votes.

    Every score and bound is ``mine / (mine + rest)`` with ``mine = table[own]``
    and ``rest`` the other classes' terms added one at a time in ascending order
    of their votes, starting from 0.0 (the canonical sum). So a bound equals, bit
    for bit, the score of the vote vector it reaches, and two bounds (or a bound
    and a score) that reach equal vote vectors are equal: an exact tie between a
    test point's bound and a threshold bound is computed as a tie.
    """
    m = others.shape[1]
    own = own_votes + min(radius, n_voters - own_votes)
    if not softmax:
        return own / n_voters
    moved = min(radius, room)
    top = others[entry, 0]
    j = 1
    while j < m and top + others[entry, j] - (j + 1) * others[entry, j] <= moved:
        top += others[entry, j]
        j += 1
    kept = top - moved
    level = kept // j
    high = kept - j * level
    # ascending: the untouched others (tail[j]), then level, then level + 1
    rest = tail[j]
    for _ in range(j - high):
        rest += table[level]
    for _ in range(high):
        rest += table[level + 1]
    mine = table[own]
    return float(mine / (mine + rest))


@inlined
def lower_bound(
    own_votes: int,
    others: IntArray,
    entry: int,
    room: int,
    tail: FloatArray,
    n_voters: int,
    table: FloatArray,
    softmax: bool,
    radius: int,
) -> float:
    """Smallest score of the entry after ``radius`` changed votes (canonical sum)."""
    m = others.shape[1]
    first = min(radius, own_votes)
    own = own_votes - first
    if not softmax:
        return own / n_voters
    drainable = room - others[entry, 0]
    joined = min(radius - first, n_voters - own_votes - room)
    drained = min(radius - first - joined, drainable)
    top = others[entry, 0] + first + joined + drained
    # the others but the largest, ascending: classes m - 1, ..., 1 of the entry
    length = m - 1
    emptied = 0
    before = 0
    if drained == 0:
        while emptied < length and others[entry, m - 1 - emptied] == 0:
            emptied += 1
    else:
        while emptied < length and before + others[entry, m - 1 - emptied] <= drained:
            before += others[entry, m - 1 - emptied]
            emptied += 1
    # ascending: the emptied classes (e^0 = 1), the partly drained one, the
    # untouched ones, the largest
    rest = 0.0
    for _ in range(emptied):
        rest += 1.0
    if emptied < length:
        rest += table[others[entry, m - 1 - emptied] - (drained - before)]
        for c in range(m - 2 - emptied, 0, -1):
            rest += table[others[entry, c]]
    rest += table[top]
    mine = table[own]
    return float(mine / (mine + rest))


@compiled
def bounds(
    own: IntArray,
    others: IntArray,
    rows: IntArray,
    radius: IntArray,
    n_voters: int,
    table: FloatArray,
    softmax: bool,
    upper: bool,
    out: FloatArray,
) -> None:
    """``out[i]``: the upper (or lower) bound of entry ``rows[i]`` at ``radius[i]``."""
    tail = np.empty(others.shape[1] + 1)
    for i in range(rows.shape[0]):
        entry = rows[i]
        room = _entry_sums(others, entry, table, tail)
        if upper:
            out[i] = upper_bound(
                own[entry],
                others,
                entry,
                room,
                tail,
                n_voters,
                table,
                softmax,
                radius[i],
            )
        else:
            out[i] = lower_bound(
                own[entry],
                others,
                entry,
                room,
                tail,
                n_voters,
                table,
                softmax,
                radius[i],
            )


@inlined
def _certified(
    own_votes: int,
    others: IntArray,
    entry: int,
    room: int,
    tail: FloatArray,
    member: bool,
    r_t: int,
    r_c: int,
    n_voters: int,
    table: FloatArray,
    softmax: bool,
    lower: FloatArray,
    upper: FloatArray,
    tau_hat: int,
    guard: int,
    tie: float,
) -> bool:
    """:meth:`PartThresholds.certified` for one entry (``r_t`` within the tables).

    Kept: ``low >= cut`` exactly; left out: ``high < cut - tie`` (the safe sides).
    """
    if r_c > 0 and r_c > guard:
        return False
    if member:
        keep_at = tau_hat + r_c
        if keep_at >= lower.shape[0]:
            return False
        low = lower_bound(
            own_votes, others, entry, room, tail, n_voters, table, softmax, r_t
        )
        return bool(low >= upper[keep_at, r_t])
    drop_at = tau_hat - r_c
    if drop_at < 0:
        return False
    high = upper_bound(
        own_votes, others, entry, room, tail, n_voters, table, softmax, r_t
    )
    return bool(high < lower[drop_at, r_t] - tie)


@compiled
def largest_radius(
    own: IntArray,
    others: IntArray,
    in_set: BoolArray,
    ceiling: IntArray,
    joint: bool,
    n_voters: int,
    table: FloatArray,
    softmax: bool,
    lower: FloatArray,
    upper: FloatArray,
    tau_hat: int,
    guard: int,
    tie: float,
    out: IntArray,
) -> None:
    """Largest certified ``r_t`` per entry, with ``r_c = 0`` or ``r_c = r_t``.

    Certification is monotone in the radii, so probes 1, 2, 4, ... run until one
    fails, then bisection; radius 0 is always certified and ``ceiling[i]`` (at most
    the tables' last column) bounds the search.
    """
    tail = np.empty(others.shape[1] + 1)
    for entry in range(own.shape[0]):
        lo = 0
        hi = ceiling[entry] + 1
        if hi <= 1:
            out[entry] = 0
            continue
        room = _entry_sums(others, entry, table, tail)
        galloping = True
        while hi - lo > 1:
            probe = min(lo + max(lo, 1), hi - 1) if galloping else (lo + hi) // 2
            ok = _certified(
                own[entry],
                others,
                entry,
                room,
                tail,
                in_set[entry],
                probe,
                probe if joint else 0,
                n_voters,
                table,
                softmax,
                lower,
                upper,
                tau_hat,
                guard,
                tie,
            )
            if ok:
                lo = probe
            else:
                hi = probe
                galloping = False
        out[entry] = lo


@compiled
def training_and_joint(
    own: IntArray,
    others: IntArray,
    in_set: BoolArray,
    radius: int,
    calibration: IntArray,
    n_voters: int,
    table: FloatArray,
    softmax: bool,
    lower: FloatArray,
    upper: FloatArray,
    tau_hat: int,
    guard: int,
    tie: float,
    training: IntArray,
    joint: IntArray,
) -> None:
    """Both searches of :func:`largest_radius` in one pass over the entries.

    ``training[i]``: largest ``r_t <= radius`` with ``r_c = 0``; ``joint[i]``:
    largest ``r`` with ``r_t = r_c = r``, searched below
    ``min(training[i], calibration[i])``. The entry's sums are computed once.
    """
    tail = np.empty(others.shape[1] + 1)
    for entry in range(own.shape[0]):
        training[entry] = 0
        joint[entry] = 0
        if radius < 1:
            continue
        room = _entry_sums(others, entry, table, tail)
        member = in_set[entry]
        for search in range(2):
            lo = 0
            top = radius if search == 0 else min(training[entry], calibration[entry])
            hi = top + 1
            galloping = True
            while hi - lo > 1:
                probe = min(lo + max(lo, 1), hi - 1) if galloping else (lo + hi) // 2
                ok = _certified(
                    own[entry],
                    others,
                    entry,
                    room,
                    tail,
                    member,
                    probe,
                    probe if search == 1 else 0,
                    n_voters,
                    table,
                    softmax,
                    lower,
                    upper,
                    tau_hat,
                    guard,
                    tie,
                )
                if ok:
                    lo = probe
                else:
                    hi = probe
                    galloping = False
            if search == 0:
                training[entry] = lo
            else:
                joint[entry] = lo
