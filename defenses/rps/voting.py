r"""RPS on part classifiers trained elsewhere (a ``PartVoter``).

:meth:`ReliableConformalClassifier.from_voter
<defenses.rps.defense.ReliableConformalClassifier.from_voter>` builds an RPS
classifier, already fitted, around ``voter.n_parts`` (``k_t``) parts whose
``voter.part_votes(X)`` gives, per part and point, a class index into ``classes`` or
-1 when the part abstains (e.g. a shard whose data were all deleted). The training
certificate assumes each training point can influence at most one part (parts
formed by a hash of the sample or its id, trained in isolation).

A voter's votes are read afresh at every call (never memoised), so a voter whose
parts changed (after a deletion) is never served stale votes; the thresholds are
those of the last ``conformalize``. With abstentions the score is
:math:`\operatorname{softmax}(v / k_t)` over the K classes, and the certificate
covers a part moving between any class and abstain (:mod:`defenses.rps.scores`).
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from defenses.checks import check_int
from defenses.rps.ensemble import PartVoter
from defenses.rps.inputs import check_classes
from defenses.rps.parts import FittedParts


def voter_parts(voter: PartVoter) -> int:
    """``k_t`` of a voter, or raise TypeError / ValueError naming what is missing."""
    if not callable(getattr(voter, "part_votes", None)):
        raise TypeError(f"voter must have a part_votes(X) method, got {voter!r}")
    return check_int("voter.n_parts", getattr(voter, "n_parts", None), 1)


def adopt_voter(
    model: Any, voter: PartVoter, classes: npt.ArrayLike, n_features: int
) -> Any:
    """Make ``model`` (built with ``n_train_parts = voter.n_parts``) use ``voter``.

    ``classes``: the labels, sorted and distinct, K >= 2 (index ``c`` of a vote is
    ``classes[c]``); ``n_features``: the number of features of ``X``.
    """
    labels = check_classes(classes)
    model._settings()
    model.voter_ = voter
    model.classes_ = labels
    model.n_features_in_ = check_int("n_features", n_features, 1)
    model._parts = FittedParts(None, voter, int(labels.size))
    return model
