"""Classification targets checked at a classifier's boundary.

Every scikit-learn-style classifier of the suite (RPS, the SSD wrapper) takes labels
of any type the user has: integers, strings, booleans, objects. What they all refuse
is the same, so it is checked here once: no ``y`` at all, ``y`` that is not one
label per row (a column vector is flattened with scikit-learn's
``DataConversionWarning``), a missing label (NaN, None, ``pandas.NA``, ``NaT``: a
missing label is no class), and targets scikit-learn does not count as classes
(continuous values, complex numbers, mixed types), via
:func:`sklearn.utils.multiclass.check_classification_targets`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import column_or_1d


def missing_labels(labels: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """Which entries of a 1-D label array are missing (NaN, None, NA or NaT).

    pandas is not imported: its missing values are recognised by type name.
    """
    if labels.dtype.kind == "f":
        return np.asarray(np.isnan(labels))
    if labels.dtype.kind in "mM":
        return np.asarray(np.isnat(labels))
    if labels.dtype.kind != "O":
        return np.zeros(labels.shape, dtype=bool)
    return np.array(
        [
            v is None
            or (isinstance(v, float | np.floating) and bool(np.isnan(v)))
            or type(v).__name__ in ("NAType", "NaTType")
            for v in labels.tolist()
        ],
        dtype=bool,
    )


def check_labels(y: Any, owner: str, n: int | None = None) -> npt.NDArray[Any]:
    """``y`` as a 1-D array of class labels with none missing.

    Parameters
    ----------
    y : array-like of shape (n,) or (n, 1)
        The labels, of any type scikit-learn counts as classes.
    owner : str
        The estimator, for the message when ``y`` is None.
    n : int or None
        The number of samples ``y`` must label (None: not checked here).

    Raises
    ------
    ValueError
        If ``y`` is None, not 1-D, of another length than ``n``, holds a missing
        label, or is not a classification target; every message names ``y``.
    TypeError
        If ``y`` mixes label types that cannot be ordered.
    """
    if y is None:
        raise ValueError(f"{owner} requires y to be passed, but the target y is None.")
    try:
        labels = column_or_1d(y, warn=True)
    except ValueError as error:
        raise ValueError(f"y: {error}") from error
    if n is not None and labels.shape[0] != n:
        raise ValueError(f"y has {labels.shape[0]} labels for {n} samples of X")
    missing = missing_labels(labels)
    if missing.any():
        raise ValueError(
            f"Input y contains NaN: {int(missing.sum())} missing label(s) (NaN, None, "
            "pandas.NA or NaT); drop or impute those rows, a missing label is no class"
        )
    try:
        check_classification_targets(labels)
    except TypeError as error:
        raise TypeError(
            f"y mixes label types that cannot be ordered ({error}); use one type"
        ) from error
    except ValueError as error:
        raise ValueError(f"y: {error}") from error
    return np.asarray(labels)
