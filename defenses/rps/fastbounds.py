r"""Constant-time score bounds that decide the certificate's comparisons first.

The canonical bounds (:func:`defenses.rps.kernels.upper_bound` and
``lower_bound``) add the other classes' terms one at a time, smallest first, so
equal vote vectors give equal bits; that costs :math:`O(K)` per probe of the
radius search. The same closed forms evaluated with precomputed partial sums
(:math:`\sum_{i \ge c} e^{o_i / k_t}` and :math:`\sum_{1 \le i \le c} e^{o_i /
k_t}`, filled once per entry) cost :math:`O(1)` after the water-filling scan but
round differently, by at most a few ulps of a score (:math:`(K + 3)` ulps each).
:func:`decide` therefore compares the fast value with the threshold and answers
only when it lies more than :data:`MARGIN` (1e-12, hundreds of times the rounding
difference) on one side; otherwise it computes the canonical bound and compares
exactly. The decisions are those of the canonical comparison, bit for bit.
"""

from __future__ import annotations

from defenses.arrays import FloatArray, IntArray
from defenses.jit import inlined

MARGIN = 1e-12
"""Fast bounds closer than this to a threshold are recomputed canonically."""


@inlined
def fill_heads(
    others: IntArray, entry: int, table: FloatArray, heads: FloatArray
) -> None:
    r"""``heads[c]`` is :math:`\sum_{1 \le i \le c} e^{o_i / k_t}`, ``heads[0] = 0``."""
    m = others.shape[1]
    head = 0.0
    heads[0] = 0.0
    for c in range(1, m):
        head += table[others[entry, c]]
        heads[c] = head


@inlined
def upper_fast(
    own_votes: int,
    others: IntArray,
    entry: int,
    room: int,
    tail: FloatArray,
    n_voters: int,
    table: FloatArray,
    radius: int,
) -> float:
    """The upper bound's closed form with partial sums (softmax scores)."""
    m = others.shape[1]
    own = own_votes + min(radius, n_voters - own_votes)
    moved = min(radius, room)
    top = others[entry, 0]
    j = 1
    while j < m and top + others[entry, j] - (j + 1) * others[entry, j] <= moved:
        top += others[entry, j]
        j += 1
    kept = top - moved
    level = kept // j
    high = kept - j * level
    rest = (j - high) * table[level] + high * table[level + 1] + tail[j]
    mine = table[own]
    return float(mine / (mine + rest))


@inlined
def lower_fast(
    own_votes: int,
    others: IntArray,
    entry: int,
    room: int,
    heads: FloatArray,
    n_voters: int,
    table: FloatArray,
    radius: int,
) -> float:
    """The lower bound's closed form with partial sums (softmax scores)."""
    m = others.shape[1]
    first = min(radius, own_votes)
    own = own_votes - first
    drainable = room - others[entry, 0]
    joined = min(radius - first, n_voters - own_votes - room)
    drained = min(radius - first - joined, drainable)
    top = others[entry, 0] + first + joined + drained
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
    rest = table[top] + float(emptied)
    if emptied < length:
        partial = others[entry, m - 1 - emptied] - (drained - before)
        rest += table[partial] + heads[m - 2 - emptied]
    mine = table[own]
    return float(mine / (mine + rest))
