r"""scikit-learn model selection for conformal set predictors.

:func:`coverage_size_scorer` makes a scorer for ``GridSearchCV`` /
``cross_val_score`` over a conformal classifier's parameters (e.g. the wrapped
estimator's ``estimator__C`` of
:class:`~defenses.rps.defense.ReliableConformalClassifier`). A fitted candidate
must be conformalized before it predicts sets, so the scorer splits the validation
fold (stratified, with a fixed seed) into a conformalization part and an evaluation
part, conformalizes a shallow copy of the candidate (the fitted parts are shared,
never refitted) and scores the evaluation part:

.. math::

    \text{score} = \begin{cases}
        -\bar{|C|} & \text{if } \widehat{\text{cov}} \ge c - t, \\
        -K - (c - \widehat{\text{cov}}) & \text{otherwise,}
    \end{cases}

with :math:`\bar{|C|}` the mean set size, :math:`\widehat{\text{cov}}` the empirical
coverage, :math:`c` the candidate's ``confidence_level``, :math:`t` the tolerance
and :math:`K` the number of classes: among candidates that cover, the smallest sets
win, and any candidate that under-covers ranks below all of them (a full set has
size :math:`K`). Higher is better, as scikit-learn expects. With a list of
confidence levels the score is the mean over the levels.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
from sklearn.model_selection import StratifiedShuffleSplit
from sklearn.utils import _safe_indexing

from defenses.checks import check_real
from defenses.rps.settings import confidence_levels

Scorer = Callable[[Any, Any, Any], float]


def coverage_size_scorer(
    conformalize_fraction: float = 0.5, tolerance: float = 0.05, seed: int = 0
) -> Scorer:
    """A ``scoring=`` callable ranking conformal classifiers by coverage and size.

    Parameters
    ----------
    conformalize_fraction : float
        Share of each validation fold used to conformalize, in (0, 1).
    tolerance : float
        Coverage below the confidence level still counted as covering, in [0, 1).
    seed : int
        Seed of the stratified split of the validation fold.

    Returns
    -------
    callable
        ``scorer(estimator, X, y) -> float`` for a fitted estimator with
        ``conformalize``, ``predict_set``, ``classes_`` and ``confidence_level``.
    """
    fraction = check_real(
        "conformalize_fraction",
        conformalize_fraction,
        0.0,
        1.0,
        open_low=True,
        open_high=True,
    )
    slack = check_real("tolerance", tolerance, 0.0, 1.0, open_high=True)
    splitter = StratifiedShuffleSplit(1, train_size=fraction, random_state=seed)

    def scorer(estimator: Any, X: Any, y: Any) -> float:
        labels = np.asarray(y)
        conf, evaluation = next(splitter.split(np.zeros((labels.size, 1)), labels))
        model = copy.copy(estimator)
        model.conformalize(_safe_indexing(X, conf), labels[conf])
        _, sets = model.predict_set(_safe_indexing(X, evaluation))
        truth = model.classes_[None, :] == labels[evaluation][:, None]
        levels, _ = confidence_levels(model.confidence_level)
        scores = []
        for i, level in enumerate(levels):
            members = sets[:, :, i]
            covered = float(np.mean(np.any(members & truth, axis=1)))
            size = float(members.sum(axis=1).mean())
            if covered >= level - slack:
                scores.append(-size)
            else:
                scores.append(-float(model.classes_.size) - (level - covered))
        return float(np.mean(scores))

    return scorer
