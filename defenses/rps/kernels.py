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

The kernels read an entry's others from its sorted row (the row without one
``own``). :func:`certified_radii` finds each entry's largest certified training
radius, and its joint one, by a scan over these bounds against the calibration
parts' threshold bounds (:class:`defenses.rps.certificate.PartThresholds`);
:func:`calibration_radii` the calibration radius by bisection.
"""

from __future__ import annotations

import numpy as np

from defenses.arrays import BoolArray, FloatArray, IntArray
from defenses.jit import compiled, inlined

BLOCK = 3
"""Probes :func:`certified_radii` makes per entry before it tests for the first
failing one (most radii are a few votes)."""


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
def _share(mine: float, rest: float) -> float:
    """A score from its own term and the others' canonical sum."""
    return float(mine / (mine + rest))


@inlined
def _gains(radius: int, own_votes: int, room: int, n_voters: int) -> tuple[int, int]:
    """The upper bound's moves: the class's votes after ``radius`` changes.

    Returns the class's new count and how many votes came from the other classes
    (the rest came from abstaining parts).
    """
    return own_votes + min(radius, n_voters - own_votes), min(radius, room)


@inlined
def _losses(
    radius: int, own_votes: int, room: int, largest: int, n_voters: int
) -> tuple[int, int, int]:
    """The lower bound's moves, in their order, all into the largest other class.

    Returns the votes taken from the class, the abstentions that join, and the
    votes drained from the other classes.
    """
    first = min(radius, own_votes)
    joined = min(radius - first, n_voters - own_votes - room)
    drained = min(radius - first - joined, room - largest)
    return first, joined, drained


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
    own, moved = _gains(radius, own_votes, room, n_voters)
    if not softmax:
        return own / n_voters
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
    return _share(table[own], rest)


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
    first, joined, drained = _losses(
        radius, own_votes, room, others[entry, 0], n_voters
    )
    own = own_votes - first
    if not softmax:
        return own / n_voters
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
    return _share(table[own], rest)


@compiled
def bounds(
    rows: IntArray,
    start: IntArray,
    own: IntArray,
    chosen: IntArray,
    radius: IntArray,
    n_voters: int,
    table: FloatArray,
    softmax: bool,
    upper: bool,
    out: FloatArray,
) -> None:
    """``out[i]``: the upper (or lower) bound of entry ``chosen[i]`` at ``radius[i]``.

    An entry's row is found by bisection of ``start``; its others (the row without
    one ``own``) are copied into a one-row scratch array.
    """
    m = rows.shape[1] - 1
    tail = np.empty(m + 1)
    others = np.empty((1, m), dtype=np.int64)
    for i in range(chosen.shape[0]):
        entry = chosen[i]
        lo = 0
        hi = rows.shape[0]
        while hi - lo > 1:  # the row r with start[r] <= entry < start[r + 1]
            mid = (lo + hi) // 2
            if start[mid] <= entry:
                lo = mid
            else:
                hi = mid
        p = 0
        while rows[lo, p] != own[entry]:
            p += 1
        for c in range(m):
            others[0, c] = rows[lo, c + (c >= p)]
        room = _entry_sums(others, 0, table, tail)
        if upper:
            out[i] = upper_bound(
                own[entry], others, 0, room, tail, n_voters, table, softmax, radius[i]
            )
        else:
            out[i] = lower_bound(
                own[entry], others, 0, room, tail, n_voters, table, softmax, radius[i]
            )


@compiled
def certified_radii(
    rows: IntArray,
    start: IntArray,
    own: IntArray,
    scores: FloatArray,
    tails: FloatArray,
    in_set: BoolArray,
    ceiling: IntArray,
    limit: IntArray,
    calibrate: bool,
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

    Entries are those of the sorted ``rows`` (:func:`~defenses.rps.entries.vote_rows`).
    ``training[i]``: the largest :math:`r \le` ``ceiling[i]`` (and the tables' last
    column) certified with :math:`r_c = 0`; ``joint[i]``: the largest
    :math:`r \le \min(` ``training[i]``, ``limit[i]`` :math:`)` certified with
    :math:`r_t = r_c = r` (:meth:`PartThresholds.certified`; kept: ``low >= cut``
    exactly, left out: ``high < cut - tie``). Radius 0 always counts. ``tails[i]``:
    ``tail[1]`` of :func:`_entry_sums`. With ``calibrate``, ``limit[i]`` is first set
    to the calibration radius at :math:`r_t = 0` (:func:`calibration_radii`, the
    parts whose sorted column-0 bound the score passes counted).

    Certification is monotone in both radii, so the training radius is the step
    before the first failing one, probed ``r = 1, 2, ...`` (most radii are a few
    votes; each probe is O(1) when no class is drained). The first :data:`BLOCK`
    probes, when all are of that O(1) kind, are made together and their outcomes
    counted without a branch (the first failure counts, a later success does not).
    A joint certificate at
    ``r`` implies the training one (the threshold columns are sorted over the
    parts, so ``upper[tau_hat + r, r] >= upper[tau_hat, r]`` and
    ``lower[tau_hat - r, r] <= lower[tau_hat, r]``), so the joint radius is
    checked in the same scan: each bound the training search certifies at
    ``r <= min(limit, guard)`` is compared with the joint thresholds at ``r`` until
    one fails, and no bound is computed twice.

    The common bounds are computed in this loop from scalars: a lower bound that
    drains no class is ``_share(e^{own - r}, tail[1] + e^{largest + r})``, an
    upper bound that moves votes from the largest other class only is
    ``_share(e^{own + r}, tail[1] + e^{largest - r})`` (the sums
    :func:`lower_bound` and :func:`upper_bound` add, in their order); the others
    (from the probe ``slow``, known in advance: the first that drains a class, or
    lowers more than the largest other class) copy the entry's others out of its
    row once and call those functions. An
    inlined helper taking arrays costs six reference count calls (about 30 ns) per
    call, more than the bound itself.
    """
    k_c = lower.shape[0]
    widest = lower.shape[1] - 1
    m = rows.shape[1] - 1
    tail = np.empty(m + 1)
    others = np.empty((1, m), dtype=np.int64)
    keep = np.ascontiguousarray(upper[:, 0])  # contiguous: the counts vectorize
    drop = np.ascontiguousarray(lower[:, 0])
    # per radius r: what a member's lower bound must reach and a class out of the
    # set's upper bound must stay below, with r_c = 0 and with r_c = r
    reach = np.full(widest + 1, np.inf)
    below = np.full(widest + 1, -np.inf)
    both_reach = np.full(widest + 1, np.inf)
    both_below = np.full(widest + 1, -np.inf)
    for r in range(widest + 1):
        if tau_hat < k_c:
            reach[r] = upper[tau_hat, r]
            below[r] = lower[tau_hat, r] - tie
        if tau_hat + r < k_c:
            both_reach[r] = upper[tau_hat + r, r]
        if tau_hat >= r:
            both_below[r] = lower[tau_hat - r, r] - tie
    for row in range(rows.shape[0]):
        total = 0
        for c in range(m + 1):
            total += rows[row, c]
        for entry in range(start[row], start[row + 1]):
            votes = own[entry]
            p = 0  # the first copy of votes in the row, found without a branch
            for c in range(m + 1):
                p += rows[row, c] > votes
            member = in_set[entry]
            if calibrate:
                score = scores[entry]
                passed = 0
                if member:
                    for part in range(k_c):
                        passed += keep[part] <= score
                    kept = passed - tau_hat - 1
                else:
                    score += tie
                    for part in range(k_c):
                        passed += drop[part] <= score
                    kept = tau_hat - passed
                limit[entry] = min(kept, guard) if kept >= 0 else -1
            top = min(ceiling[entry], widest)
            found = 0
            both = 0
            alive = True
            cap = min(limit[entry], guard)
            if top >= 1:
                largest = rows[row, 1] if p == 0 else rows[row, 0]
                second = 0 if m == 1 else rows[row, 2] if p <= 1 else rows[row, 1]
                rest = tails[entry]  # tail[1], as _entry_sums adds it
                room = total - votes
                # the first probe that drains a class (a member) or lowers more
                # than the largest other class (not a member): from there on the
                # bounds need the entry's other counts, copied out of its row once
                slow = top + 1
                if softmax and member and room > largest:
                    slow = n_voters - room + 1
                elif softmax and not member and m > 1:
                    slow = max(largest - second, 1)
                if softmax and slow > BLOCK and top >= BLOCK:
                    # the first BLOCK probes, quick ones, with no branch between
                    # them (a scan's exit is a mispredicted branch per entry)
                    held = kept = 1
                    if member:
                        for r in range(1, BLOCK + 1):
                            moves = _losses(r, votes, room, largest, n_voters)
                            first, joined, _ = moves
                            grown = largest + first + joined
                            bound = _share(table[votes - first], rest + table[grown])
                            held &= bound >= reach[r]
                            kept &= held & (bound >= both_reach[r]) & (r <= cap)
                            found += held
                            both += kept
                    else:
                        for r in range(1, BLOCK + 1):
                            mine, moved = _gains(r, votes, room, n_voters)
                            gone = largest - moved
                            bound = _share(table[mine], rest + table[gone])
                            held &= bound < below[r]
                            kept &= held & (bound < both_below[r]) & (r <= cap)
                            found += held
                            both += kept
                    alive = kept == 1
                    if found < BLOCK:
                        top = found  # the first failing probe was found
                while found < top:
                    r = found + 1
                    if r == slow:
                        for c in range(m):
                            others[0, c] = rows[row, c + (c >= p)]
                        _entry_sums(others, 0, table, tail)
                    if member:
                        first, joined, drained = _losses(
                            r, votes, room, largest, n_voters
                        )
                        if not softmax:
                            bound = (votes - first) / n_voters
                        elif drained == 0:  # lower_bound without a drained class
                            grown = largest + first + joined
                            bound = _share(table[votes - first], rest + table[grown])
                        else:
                            bound = lower_bound(
                                votes, others, 0, room, tail, n_voters, table, True, r
                            )
                        ok = bound >= reach[r]
                    else:
                        mine, moved = _gains(r, votes, room, n_voters)
                        if not softmax:
                            bound = mine / n_voters
                        elif m == 1 or largest - second > moved:
                            # upper_bound when only the largest other class loses
                            bound = _share(table[mine], rest + table[largest - moved])
                        else:
                            bound = upper_bound(
                                votes, others, 0, room, tail, n_voters, table, True, r
                            )
                        ok = bound < below[r]
                    if not ok:
                        break
                    found = r
                    if alive and r <= cap:
                        if member:
                            alive = bound >= both_reach[r]
                        else:
                            alive = bound < both_below[r]
                        both += alive
            training[entry] = found
            joint[entry] = both


@compiled
def calibration_radii(
    low: FloatArray,
    high: FloatArray,
    in_set: BoolArray,
    lower: FloatArray,
    upper: FloatArray,
    radius: int,
    tau_hat: int,
    guard: int,
    tie: float,
    out: IntArray,
) -> None:
    r"""Largest certified calibration radius per entry at training radius ``radius``.

    :meth:`PartThresholds.calibration_radius
    <defenses.rps.certificate.PartThresholds.calibration_radius>`: a member is kept
    by the :math:`g` parts whose upper threshold bound is at most its lower score
    bound ``low`` (column ``radius`` of ``upper``, sorted), so ``r_c = g - tau_hat -
    1``; a class out of the set is left out by every part but the :math:`g` whose
    lower threshold bound is at most ``high + tie``, so ``r_c = tau_hat - g``.
    Capped at ``guard``; -1 where not certified. :math:`g` is found by bisection
    (``numpy.searchsorted(..., side="right")``).
    """
    k_c = lower.shape[0]
    for entry in range(in_set.shape[0]):
        member = in_set[entry]
        value = low[entry] if member else high[entry] + tie
        lo = 0
        hi = k_c
        while lo < hi:
            mid = (lo + hi) // 2
            cut = upper[mid, radius] if member else lower[mid, radius]
            if cut <= value:
                lo = mid + 1
            else:
                hi = mid
        found = lo - tau_hat - 1 if member else tau_hat - lo
        out[entry] = min(found, guard) if found >= 0 else -1
