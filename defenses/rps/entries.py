"""Compiled counting, sorting and entry building of vote rows (:class:`VoteGeometry`).

:func:`count_votes` counts the part predictions per point and class;
:func:`vote_entries` sorts each point's votes, finds the distinct sorted rows and
turns them into entries, one per distinct vote count of a row (see
:class:`defenses.rps.scores.VoteGeometry`), with their scores
(:func:`entry_scores`), and maps every (point, class) to its entry;
:func:`point_sets` gives each point's best class and its sets.
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


@inlined
def _mix(key: int) -> int:
    """A hash of a row's key (the finaliser of splitmix64, wrapping int64)."""
    key ^= key >> 31
    key *= -7046029254386353131
    key ^= key >> 29
    return key


@compiled
def vote_entries(
    votes: IntArray, table: FloatArray
) -> tuple[IntArray, IntArray, IntArray, FloatArray, FloatArray]:
    """The entries of a batch of vote rows, and each point's, in two passes.

    Each point's votes are sorted descending (insertion sort: rows are short) and
    looked up in an open-addressing table of the distinct sorted rows seen so far
    (hashed, then compared in full: exact). A new row gets the next block of
    entries, one per distinct vote count in descending order; ``index[p, c]`` is
    its block's start plus the rank of ``votes[p, c]`` among the row's distinct
    counts. Rows get their blocks in the order of their first point. The second
    pass fills each entry's ``own`` count, ``others`` (the sorted row without one
    ``own``); :func:`entry_scores` then gives each entry its softmax score and
    tail.
    """
    n, k = votes.shape
    m = k - 1
    slots = 16
    while slots < 2 * n:
        slots *= 2
    mask = slots - 1
    slot = np.full(slots, -1, dtype=np.int64)
    ordered = np.empty((n, k), dtype=np.int64)
    first = np.empty(n, dtype=np.int64)
    start = np.zeros(n + 1, dtype=np.int64)
    index = np.empty((n, k), dtype=np.int64)
    top = 0
    for p in range(n):
        for c in range(k):
            top = max(top, votes[p, c])
    rank = np.empty(top + 1, dtype=np.int64)
    rows = 0
    for p in range(n):
        for c in range(k):
            value = votes[p, c]
            j = c
            while j > 0 and ordered[p, j - 1] < value:
                ordered[p, j] = ordered[p, j - 1]
                j -= 1
            ordered[p, j] = value
        distinct = 0
        rank[ordered[p, 0]] = 0
        key = ordered[p, 0]
        for c in range(1, k):
            distinct += int(ordered[p, c] != ordered[p, c - 1])
            rank[ordered[p, c]] = distinct
            key = key * 1000003 + ordered[p, c]
        at = _mix(key) & mask
        while True:
            row = slot[at]
            if row < 0:  # a new sorted row: the next block of entries
                row = rows
                slot[at] = row
                first[row] = p
                start[row + 1] = start[row] + distinct + 1
                rows += 1
                break
            q = first[row]
            same = True
            for c in range(k):
                if ordered[q, c] != ordered[p, c]:
                    same = False
                    break
            if same:
                break
            at = (at + 1) & mask
        for c in range(k):
            index[p, c] = start[row] + rank[votes[p, c]]
    size = start[rows]
    own = np.empty(size, dtype=np.int64)
    others = np.empty((size, m), dtype=np.int64)
    scores = np.empty(size)
    tails = np.empty(size)
    for row in range(rows):
        q = first[row]
        e = start[row]
        for c in range(k):
            if c > 0 and ordered[q, c] == ordered[q, c - 1]:
                continue
            own[e] = ordered[q, c]
            for o in range(c):
                others[e, o] = ordered[q, o]
            for o in range(c, m):
                others[e, o] = ordered[q, o + 1]
            e += 1
    entry_scores(own, others, table, scores, tails)
    return own, others, index, scores, tails


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
