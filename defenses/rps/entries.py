"""Compiled sorting and entry building of vote rows (:class:`VoteGeometry`'s input).

:func:`descending_rows` sorts each point's votes; :func:`vote_entries` turns the
distinct sorted rows into entries, one per distinct vote count of a row (see
:class:`defenses.rps.scores.VoteGeometry`), and maps every (point, class) to its
entry.
"""

from __future__ import annotations

import numpy as np

from defenses.arrays import FloatArray, IntArray
from defenses.jit import compiled


@compiled
def descending_rows(votes: IntArray) -> IntArray:
    """Each row of ``votes`` sorted descending (insertion sort: rows are short)."""
    n, k = votes.shape
    out = np.empty((n, k), dtype=np.int64)
    for p in range(n):
        for c in range(k):
            value = votes[p, c]
            j = c
            while j > 0 and out[p, j - 1] < value:
                out[p, j] = out[p, j - 1]
                j -= 1
            out[p, j] = value
    return out


@compiled
def vote_entries(
    ordered: IntArray, rows: IntArray, inverse: IntArray, votes: IntArray, top: int
) -> tuple[IntArray, IntArray, IntArray]:
    """The entries of the distinct sorted rows ``ordered[rows]``, and each point's.

    Returns ``own``, ``others`` (the sorted row without the entry's position) and
    ``index`` (n, K) of each (point, class). Entries run row by row, one per
    distinct vote count, in descending order; point ``p`` has row
    ``inverse[p]``. ``top`` bounds every
    vote count (``n_voters``): a point's entries are found through a table from
    vote count to its rank among the row's distinct counts, O(K) per point.
    """
    n, k = votes.shape
    d = rows.shape[0]
    start = np.zeros(d + 1, dtype=np.int64)
    for i in range(d):
        distinct = 1
        for c in range(1, k):
            distinct += int(ordered[rows[i], c] != ordered[rows[i], c - 1])
        start[i + 1] = start[i] + distinct
    size = start[d]
    own = np.empty(size, dtype=np.int64)
    others = np.empty((size, k - 1), dtype=np.int64)
    for i in range(d):
        r = rows[i]
        at = start[i]
        for c in range(k):
            if c > 0 and ordered[r, c] == ordered[r, c - 1]:
                continue
            own[at] = ordered[r, c]
            for o in range(c):
                others[at, o] = ordered[r, o]
            for o in range(c, k - 1):
                others[at, o] = ordered[r, o + 1]
            at += 1
    index = np.empty((n, k), dtype=np.int64)
    rank = np.empty(top + 1, dtype=np.int64)
    for p in range(n):
        # the point's own sorted row holds the counts of its distinct row
        distinct = 0
        rank[ordered[p, 0]] = 0
        for o in range(1, k):
            distinct += int(ordered[p, o] != ordered[p, o - 1])
            rank[ordered[p, o]] = distinct
        first = start[inverse[p]]
        for c in range(k):
            index[p, c] = first + rank[votes[p, c]]
    return own, others, index


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
