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

:func:`certified_radii` finds each entry's largest certified training radius, and
its joint one, by a scan over these bounds against the calibration parts'
threshold bounds (:class:`defenses.rps.certificate.PartThresholds`).
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
    # ascending: the others but the largest (the emptied classes at e^0 = 1, the
    # partly drained one, the untouched ones), then the largest
    if drained == 0:
        rest = tail[1]  # nothing drained: the same terms in the same order
    else:
        length = m - 1
        emptied = 0
        before = 0
        while emptied < length and before + others[entry, m - 1 - emptied] <= drained:
            before += others[entry, m - 1 - emptied]
            emptied += 1
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


@compiled
def certified_radii(
    own: IntArray,
    others: IntArray,
    in_set: BoolArray,
    ceiling: IntArray,
    limit: IntArray,
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
    r"""Largest certified training and joint radii per entry, in one pass.

    ``training[i]``: the largest :math:`r \le` ``ceiling[i]`` (and the tables' last
    column) certified with :math:`r_c = 0`; ``joint[i]``: the largest
    :math:`r \le \min(` ``training[i]``, ``limit[i]`` :math:`)` certified with
    :math:`r_t = r_c = r` (:meth:`PartThresholds.certified`; kept: ``low >= cut``
    exactly, left out: ``high < cut - tie``). Radius 0 always counts.

    Certification is monotone in both radii, so the training radius is the step
    before the first failing one, probed ``r = 1, 2, ...`` (most radii are a few
    votes; each probe is O(1) when no class is drained). A joint certificate at
    ``r`` implies the training one (the threshold columns are sorted over the
    parts, so ``upper[tau_hat + r, r] >= upper[tau_hat, r]`` and
    ``lower[tau_hat - r, r] <= lower[tau_hat, r]``), so the joint search compares
    the score bounds the training search computed (kept in ``seen``) with other
    thresholds and computes none. Every comparison is written in this loop:
    an inlined helper taking arrays costs reference counting per call, about as
    much as the bound itself.
    """
    k_c = lower.shape[0]
    widest = lower.shape[1] - 1
    tail = np.empty(others.shape[1] + 1)
    seen = np.empty(widest + 1)
    for entry in range(own.shape[0]):
        top = min(ceiling[entry], widest)
        member = in_set[entry]
        found = 0
        if top >= 1:
            votes = own[entry]
            room = _entry_sums(others, entry, table, tail)
            while found < top:
                r = found + 1
                if member:
                    bound = lower_bound(
                        votes, others, entry, room, tail, n_voters, table, softmax, r
                    )
                    ok = tau_hat < k_c and bound >= upper[tau_hat, r]
                else:
                    bound = upper_bound(
                        votes, others, entry, room, tail, n_voters, table, softmax, r
                    )
                    ok = bound < lower[tau_hat, r] - tie
                seen[r] = bound
                if not ok:
                    break
                found = r
        training[entry] = found
        both = 0
        last = min(found, limit[entry], guard)
        while both < last:
            r = both + 1
            if member:
                ok = tau_hat + r < k_c and seen[r] >= upper[tau_hat + r, r]
            else:
                ok = tau_hat >= r and seen[r] < lower[tau_hat - r, r] - tie
            if not ok:
                break
            both = r
        joint[entry] = both
