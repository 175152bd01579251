"""Compile every RPS kernel path ahead of time (run by ``python -m defenses.jit``).

RPS's compiled loops (:mod:`defenses.rps.kernels`, :mod:`defenses.rps.entries`) are
compiled for the argument types a call brings (:mod:`defenses.jit`): the vote counts,
the rows' sort and entries, the entry scores, the score bounds, the radius scan, the
calibration radii and the votes memo's comparison, with softmax scores and raw vote
fractions, with and without abstaining parts, and a single model's probabilities.
:func:`run` makes one small call of each path, so that every later process loads them
from the cache instead of compiling on its first request.
"""

from __future__ import annotations

import numpy as np


def run() -> None:
    """One fit, conformalize, predict_set and certify per kernel path."""
    from defenses.rps.calibration import calibrate_parts
    from defenses.rps.certificate import ProbaGeometry, certify_batch
    from defenses.rps.entries import point_sets
    from defenses.rps.parts import same_words
    from defenses.rps.scores import vote_counts, vote_geometry

    rng = np.random.default_rng(0)
    k_t, classes = 5, 3
    vote_counts(rng.integers(0, classes, (k_t, 40)), classes)
    for abstain in (False, True):
        votes = rng.multinomial(k_t, np.ones(classes) / classes, size=40)
        if abstain:
            votes[::3, 0] = np.maximum(votes[::3, 0] - 1, 0)
        for softmax in (True, False):
            geometry = vote_geometry(votes, k_t, softmax, abstain)
            labels = rng.integers(0, classes, votes.shape[0])
            entries = geometry.index[np.arange(votes.shape[0]), labels]
            parts = np.array_split(np.arange(votes.shape[0]), 2)
            bounds = calibrate_parts(parts, entries, geometry, 0.2, "official", k_t)
            certificate = certify_batch(geometry, bounds.part_thresholds, k_t)
            certificate.calibration_radius(1)
            in_set = geometry.score() >= bounds.part_thresholds.cut
            geometry.largest(bounds.part_thresholds, in_set, joint=True)
            point_sets(geometry.score(), geometry.index, np.ones(1))
            assert geometry.others.shape == (geometry.size, classes - 1)
    single = ProbaGeometry(rng.dirichlet(np.ones(classes), size=votes.shape[0]))
    certify_batch(single, bounds.part_thresholds, 0)  # one training part
    point_sets(single.score(), single.index, np.ones(1))
    words = np.zeros(70, dtype=np.uint64)
    same_words(words, words)  # the votes memo's comparison
