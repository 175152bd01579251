"""Compiled counting, sorting and entry building of vote rows (:class:`VoteGeometry`).

:func:`count_votes` counts the part predictions per point and class;
:func:`vote_rows` sorts each point's votes, finds the distinct sorted rows and
their entries, one per distinct vote count of a row (see
:class:`defenses.rps.scores.VoteGeometry`), with their scores (:func:`row_scores`,
equal to :func:`entry_scores` of the written-out entries), and maps every (point,
class) to its entry; :func:`point_sets` gives each point's best class and its sets.
"""

from __future__ import annotations

import numpy as np

from defenses.arrays import BoolArray, FloatArray, IntArray
from defenses.jit import compiled, inlined


@compiled
def count_votes(predictions: IntArray, n_classes: int, low: int) -> IntArray:
    """Votes per class, shape (n, K), of part predictions of shape (k_t, n).

    A prediction ``-1`` counts for no class (an abstaining part) when ``low`` is
    -1; the counts' first row is -1 when a prediction lies outside
    ``[low, n_classes)`` (the caller raises).
    """
    k_t, n = predictions.shape
    counts = np.zeros((n, n_classes), dtype=np.int64)
    for i in range(k_t):
        for p in range(n):
            c = predictions[i, p]
            if 0 <= c < n_classes:
                counts[p, c] += 1
            elif c < low or c >= n_classes:
                counts[0, 0] = -1
                return counts
    return counts


@compiled
def entry_scores(
    own: IntArray,
    others: IntArray,
    table: FloatArray,
    out: FloatArray,
    tails: FloatArray,
) -> None:
    """The softmax score of each entry, ``out[e] = m / (m + rest)``, and its tail.

    ``m = table[own[e]]`` and ``rest`` the others' terms added smallest first from
    0.0: the canonical sum of :func:`defenses.rps.kernels.upper_bound`, whose
    radius-0 value this equals bit for bit (``others`` rows are sorted descending).
    ``tails[e]`` is that sum before the largest other class's term (``tail[1]`` of
    :func:`defenses.rps.kernels.certified_radii`).
    """
    m = others.shape[1]
    for e in range(own.shape[0]):
        rest = 0.0
        for c in range(m - 1, 0, -1):
            rest += table[others[e, c]]
        tails[e] = rest
        rest += table[others[e, 0]]
        mine = table[own[e]]
        out[e] = mine / (mine + rest)


@compiled
def row_scores(
    rows: IntArray,
    start: IntArray,
    own: IntArray,
    table: FloatArray,
    shifted: bool,
    scores: FloatArray,
    tails: FloatArray,
) -> None:
    """:func:`entry_scores` of every entry of the sorted rows, sharing their sums.

    Entry ``e`` of row ``r`` (``start[r] <= e < start[r + 1]``) is ``own[e]`` and the
    row without one copy of it. Its canonical sum adds the others smallest first
    from 0.0: those below the removed copy (the removed one is the copy of highest
    ascending position, so that holds for equal counts too), which are the same for
    every entry of the row (``prefix``, added once per row), then those above it,
    one at a time. The same additions in the same order as :func:`entry_scores`,
    so the same bits; the row's largest term is added last, so ``tails[e]`` is the
    sum before it. ``shifted``: the scores (not the tails) of the row minus its
    smallest count (:func:`defenses.rps.scores.canonical_scores` with abstentions).
    """
    k = rows.shape[1]
    prefix = np.empty(k + 1)
    for row in range(rows.shape[0]):
        low = rows[row, k - 1] if shifted else 0
        total = 0.0
        prefix[0] = 0.0
        for i in range(k):
            total += table[rows[row, k - 1 - i] - low]
            prefix[i + 1] = total
        p = 0
        for e in range(start[row], start[row + 1]):
            while rows[row, p] != own[e]:
                p += 1
            if p == 0:  # the largest count: every other term is below it
                tail = prefix[k - 2]
                rest = prefix[k - 1]
            else:
                rest = prefix[k - 1 - p]
                for c in range(p - 1, 0, -1):
                    rest += table[rows[row, c] - low]
                tail = rest
                rest += table[rows[row, 0] - low]
            if not shifted:
                tails[e] = tail
            mine = table[own[e] - low]
            scores[e] = mine / (mine + rest)


@inlined
def _mix(key: int) -> int:
    """A hash of a row's key (the finaliser of splitmix64, wrapping int64)."""
    key ^= key >> 31
    key *= -7046029254386353131
    key ^= key >> 29
    return key


@compiled
def vote_rows(
    votes: IntArray, table: FloatArray
) -> tuple[IntArray, IntArray, IntArray, IntArray, FloatArray, FloatArray]:
    """The distinct sorted rows of a batch of votes, their entries, and each point's.

    Each point's votes are sorted descending by rank (a count's rank is the number
    of counts above it, ties by class: branch-free, no insertion loop) and looked
    up in an open-addressing table of the distinct sorted rows seen so far
    (hashed, then compared in full: exact). A new row gets the next block of
    entries, one per distinct count in descending order (``start[r]`` to
    ``start[r + 1]``); ``index[p, c]`` is its block's start plus the rank of
    ``votes[p, c]`` among the row's distinct counts. Rows get their blocks in the
    order of their first point. Returns ``rows`` (distinct sorted rows),
    ``start``, each entry's ``own`` count, ``index`` and, from
    :func:`row_scores`, the entries' softmax scores and tails. An entry's
    ``others`` is its row without one ``own`` (:func:`row_others`); they are not
    written out.
    """
    n, k = votes.shape
    slots = 16
    while slots < 2 * n:
        slots *= 2
    mask = slots - 1
    slot = np.full(slots, -1, dtype=np.int64)
    rows = np.empty((n, k), dtype=np.int64)
    start = np.zeros(n + 1, dtype=np.int64)
    index = np.empty((n, k), dtype=np.int64)
    line = np.empty(k, dtype=np.int64)
    keys = np.empty(k, dtype=np.int64)
    rank = np.empty(table.shape[0], dtype=np.int64)  # votes <= k_t: table's size
    own = np.empty(n * k, dtype=np.int64)
    count = 0
    for p in range(n):
        for c in range(k):
            keys[c] = votes[p, c] * k + (k - 1 - c)  # distinct: ties by class
        for c in range(k):
            above = 0
            for j in range(k):
                above += keys[j] > keys[c]
            line[above] = votes[p, c]
        distinct = 0
        rank[line[0]] = 0
        key = line[0]
        for c in range(1, k):
            distinct += int(line[c] != line[c - 1])
            rank[line[c]] = distinct
            key = key * 1000003 + line[c]
        at = _mix(key) & mask
        while True:
            row = slot[at]
            if row < 0:  # a new sorted row: the next block of entries
                row = count
                slot[at] = row
                e = start[row]
                for c in range(k):
                    rows[row, c] = line[c]
                    if c == 0 or line[c] != line[c - 1]:
                        own[e] = line[c]
                        e += 1
                start[row + 1] = e
                count += 1
                break
            same = True
            for c in range(k):
                if rows[row, c] != line[c]:
                    same = False
                    break
            if same:
                break
            at = (at + 1) & mask
        block = start[row]
        for c in range(k):
            index[p, c] = block + rank[votes[p, c]]
    size = start[count]
    own = own[:size]
    rows = rows[:count]
    scores = np.empty(size)
    tails = np.empty(size)
    row_scores(rows, start, own, table, False, scores, tails)
    return rows, start[: count + 1], own, index, scores, tails


@compiled
def row_others(rows: IntArray, start: IntArray, own: IntArray) -> IntArray:
    """Each entry's other counts, sorted descending: its row without one ``own``."""
    k = rows.shape[1]
    others = np.empty((own.shape[0], k - 1), dtype=np.int64)
    for row in range(rows.shape[0]):
        for e in range(start[row], start[row + 1]):
            p = 0
            while rows[row, p] != own[e]:
                p += 1
            for c in range(k - 1):
                others[e, c] = rows[row, c + (c >= p)]
    return others


@compiled
def point_sets(
    scores: FloatArray, index: IntArray, cuts: FloatArray
) -> tuple[IntArray, BoolArray]:
    """Each point's best class and its sets at every cut, from entry scores.

    ``best[p]`` is ``numpy.argmax`` of the point's scores ``scores[index[p]]`` (the
    first largest; scores are never NaN: vote scores are ratios of exponentials,
    a model's probabilities are checked finite); ``sets[p, c, l]`` is
    ``score >= cuts[l]``.
    """
    n, k = index.shape
    levels = cuts.shape[0]
    best = np.empty(n, dtype=np.int64)
    sets = np.empty((n, k, levels), dtype=np.bool_)
    flat = sets.reshape(n * k, levels)
    for p in range(n):
        top = scores[index[p, 0]]
        first = 0
        for c in range(k):
            value = scores[index[p, c]]
            if value > top:
                first = c
                top = value
            for level in range(levels):
                flat[p * k + c, level] = value >= cuts[level]
        best[p] = first
    return best, sets


@compiled
def point_radii(
    index: IntArray,
    in_set: BoolArray,
    training: IntArray,
    calibration: IntArray,
    joint: IntArray,
) -> tuple[BoolArray, IntArray, IntArray, IntArray]:
    """The certificate's (n, K) arrays from per-entry ones, in one pass over ``index``.

    ``in_set[index]``, ``training[index]``, ``calibration[index]`` and
    ``joint[index]``, written into new arrays (numpy's four gathers read ``index``
    four times).
    """
    n, k = index.shape
    sets = np.empty((n, k), dtype=np.bool_)
    train = np.empty((n, k), dtype=np.int64)
    calib = np.empty((n, k), dtype=np.int64)
    both = np.empty((n, k), dtype=np.int64)
    for p in range(n):
        for c in range(k):
            e = index[p, c]
            sets[p, c] = in_set[e]
            train[p, c] = training[e]
            calib[p, c] = calibration[e]
            both[p, c] = joint[e]
    return sets, train, calib, both
