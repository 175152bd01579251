"""Before any attack: the validation split, and the records an audit cannot trust.

**The validation split.** A post-processing defense is fitted on records (SSD's class
prototypes are mean answers over validation records). Fitted on the records the
audit evaluates (the non-members are membership candidates; the test records give
the utility), a defense would be tuned on its own exam. Unless ``validation=`` is
given, :func:`carve_validation` holds out :data:`VAL_FRACTION` of each class of the
test records (when ``test=`` is given) or of the non-members (otherwise), with a
fixed seed, so the split is the same at every seed; those records are then neither
candidates nor utility records. The report states where the validation records came
from.

**Degenerate inputs.** :func:`degenerate_inputs` names what makes the numbers of an
audit meaningless or fragile: fewer than :data:`MIN_RECORDS` members or non-members
(the ROC has too few points for a rate at 1% FPR), records that are both members and
non-members (exact duplicate rows: membership is undefined for them), a single class
among the members or non-members, and validation records that are also evaluated.
:func:`degenerate_answers` names answers that make every attack meaningless: the
same probabilities for every record, or answers that carry no information about the
labels. Each is a warning (:class:`AuditInputWarning`, printed on stderr by Python's
warning machinery) and a line of the report.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.data import Dataset

VAL_FRACTION = 0.25
"""Share of each class held out for fitting defenses when no validation is given."""

VAL_SEED = 0
"""Seed of the carved validation split (one split for every seed of the audit)."""

MIN_RECORDS = 50
"""Fewest members (and non-members) an audit takes without a warning."""


class AuditInputWarning(UserWarning):
    """The records handed to an audit make its numbers unreliable (see the text)."""


@dataclass(frozen=True, eq=False)
class Split:
    """The records after the validation split and where the validation came from."""

    non_members: Dataset
    test: Dataset
    val: Dataset
    source: str


def _carve(data: Dataset, fraction: float) -> tuple[IntArray, IntArray]:
    """Indices kept and held out: ``fraction`` of each class with >= 2 records."""
    rng = np.random.default_rng(VAL_SEED)
    held: list[IntArray] = []
    for label in np.unique(data.y):
        rows = np.flatnonzero(data.y == label)
        if rows.size < 2:
            continue
        take = int(min(max(round(fraction * rows.size), 1), rows.size - 1))
        held.append(rng.permutation(rows)[:take])
    out = np.sort(np.concatenate([np.empty(0, dtype=np.int64), *held]))
    keep = np.setdiff1d(np.arange(len(data)), out)
    return keep.astype(np.int64), out.astype(np.int64)


def carve_validation(
    non_members: Dataset, test: Dataset | None, val: Dataset | None
) -> Split:
    """The non-member, test and validation records an audit uses (see the module).

    Parameters
    ----------
    non_members : Dataset
        The non-members as given.
    test, val : Dataset or None
        The test and validation records as given (None: not given).
    """
    if val is not None:
        return Split(non_members, non_members if test is None else test, val, "given")
    if test is not None:
        keep, held = _carve(test, VAL_FRACTION)
        return Split(
            non_members,
            test.subset(keep),
            test.subset(held),
            f"carved from the test records ({VAL_FRACTION:.0%} of each class, "
            "seeded; not used for utility)",
        )
    keep, held = _carve(non_members, VAL_FRACTION)
    rest = non_members.subset(keep)
    return Split(
        rest,
        rest,
        non_members.subset(held),
        f"carved from the non-members ({VAL_FRACTION:.0%} of each class, seeded; "
        "neither membership candidates nor utility records)",
    )


def _shared_rows(a: Dataset, b: Dataset) -> int:
    """How many rows of ``b`` are also rows of ``a`` (exact float64 values)."""
    if a.X.shape[1] != b.X.shape[1]:
        return 0
    seen = {row.tobytes() for row in np.ascontiguousarray(a.X, dtype=np.float64)}
    rows = np.ascontiguousarray(b.X, dtype=np.float64)
    return sum(row.tobytes() in seen for row in rows)


def degenerate_inputs(
    members: Dataset, non_members: Dataset, test: Dataset, val: Dataset
) -> list[str]:
    """The reasons the audit's numbers may mislead (empty when none)."""
    found = []
    for name, data in (("members", members), ("non-members", non_members)):
        if len(data) < MIN_RECORDS:
            found.append(
                f"only {len(data)} {name} (fewer than {MIN_RECORDS}): the ROC has "
                "too few points for TPR at low FPR, and every rate has a wide "
                "confidence interval"
            )
        if np.unique(data.y).size == 1:
            found.append(
                f"the {name} hold a single class ({int(data.y[0])}): the "
                "label-based attacks measure that class only"
            )
    shared = _shared_rows(members, non_members)
    if shared == len(non_members):
        found.append(
            "members and non-members are the same records (every non-member is a "
            "member row): membership is undefined and the numbers mean nothing"
        )
    elif shared:
        found.append(
            f"{shared} non-member rows are also member rows (exact duplicates): "
            "they count as non-members although the model was trained on them"
        )
    for name, data in (("members", members), ("non-members", non_members)):
        overlap = _shared_rows(data, val)
        if overlap:
            found.append(
                f"{overlap} validation rows are also {name}: the defenses are "
                "fitted on records the audit evaluates"
            )
    if test is not non_members:
        overlap = _shared_rows(test, val)
        if overlap:
            found.append(
                f"{overlap} validation rows are also test rows: the defenses are "
                "fitted on the records their utility is measured on"
            )
    return found


def warn_all(reasons: list[str]) -> None:
    """Issue one :class:`AuditInputWarning` per reason (stderr by default)."""
    for reason in reasons:
        warnings.warn(f"audit: {reason}", AuditInputWarning, stacklevel=3)


LABEL_SHUFFLES = 200
"""Label shuffles of the label-independence test (:func:`degenerate_answers`)."""

LABEL_QUANTILE = 0.99
"""The true labels must beat this quantile of the shuffled labels' statistic."""


def _describe_row(row: npt.NDArray[np.float64]) -> str:
    k = row.size
    if np.all(row == row[0]):
        return f"uniform, {row[0]:.3g} for each of {k} classes"
    if np.max(row) == 1.0 and np.count_nonzero(row) == 1:
        return f"one-hot on class {int(np.argmax(row))} for every record"
    shown = ", ".join(f"{v:.3g}" for v in row[:5])
    return f"[{shown}{', ...' if k > 5 else ''}] for every record"


def degenerate_answers(
    predict: Callable[[FloatArray], FloatArray], records: Sequence[Dataset]
) -> list[str]:
    r"""The reasons the model's answers make every attack meaningless (empty if none).

    * **Constant answers**: every record gets the same probability row (uniform,
      the same one-hot, or any fixed row). Nothing in the answers depends on the
      record, so every attack is at chance by construction.
    * **Label-independent answers**: the answers vary, but carry no measurable
      information about the labels. The statistic is the mean probability of the
      true class, :math:`T = \frac1n \sum_i p_{i, y_i}`; under shuffled labels it
      has the null distribution of answers independent of the labels. The answers
      are flagged when :math:`T` is at most the :data:`LABEL_QUANTILE` quantile of
      :data:`LABEL_SHUFFLES` shuffles (seeded: the same verdict every run).

    Parameters
    ----------
    predict : callable
        Flat rows to the model's probabilities.
    records : sequence of Dataset
        The records to ask about (members and non-members); labels are column
        indices of the answers.
    """
    X = np.concatenate([np.asarray(d.X, dtype=np.float64) for d in records])
    y = np.concatenate([np.asarray(d.y, dtype=np.int64) for d in records])
    if X.shape[0] < 2:
        return []
    proba = np.asarray(predict(X), dtype=np.float64)
    if np.all(proba == proba[0]):
        return [
            f"the model answers the same probabilities for every one of the "
            f"{X.shape[0]} members and non-members ({_describe_row(proba[0])}): its "
            "answers say nothing about any record, so every attack is at chance by "
            "construction and the audit measures nothing about the training data"
        ]
    rows = np.arange(y.size)
    observed = float(proba[rows, y].mean())
    rng = np.random.default_rng(VAL_SEED)
    shuffled = np.array(
        [proba[rows, rng.permutation(y)].mean() for _ in range(LABEL_SHUFFLES)]
    )
    cut = float(np.quantile(shuffled, LABEL_QUANTILE))
    if observed <= cut:
        return [
            "the model's answers do not depend on the labels: the mean probability "
            f"of the true class ({observed:.4f}) is no higher than with shuffled "
            f"labels ({LABEL_QUANTILE:.0%} of {LABEL_SHUFFLES} shuffles reach "
            f"{cut:.4f}); attacks that read the answer to the true label are at "
            "chance by construction, and a low attack success says nothing about "
            "privacy"
        ]
    return []
