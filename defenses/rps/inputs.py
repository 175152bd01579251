"""The boundary of the RPS estimator: inputs checked, never converted.

Features are handed to the part estimators as the user gave them (a DataFrame with
string columns for a ``Pipeline``, a sparse matrix, NaN for an estimator that
accepts it); this module only checks what every estimator needs (two dimensions, at
least one sample and one feature), turns lists into arrays and sparse formats
without row indexing (COO, DIA, DOK, BSR, LIL) into CSR. Labels of any type
are encoded into ``0..K-1`` against the sorted classes; a missing label (NaN, None,
``pandas.NA``) is refused, since it is no class.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import sparse
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_array, column_or_1d

from defenses.rps.partition import is_frame

IntArray = npt.NDArray[np.int64]


def check_inputs(X: Any, name: str = "X") -> Any:
    """``X`` itself (a DataFrame, sparse matrix or array), or an array for a list.

    Raises
    ------
    ValueError
        If ``X`` is not two-dimensional or has no sample or no feature (messages as
        scikit-learn's ``check_array``).
    """
    if X is None:
        raise ValueError(
            f"{name} must be an array-like of shape (n_samples, n), got None"
        )
    if is_frame(X):
        n, d = X.shape
        if n < 1:
            raise ValueError(
                f"Found array with 0 sample(s) (shape={X.shape}) while a minimum of 1 "
                f"is required ({name})."
            )
        if d < 1:
            raise ValueError(
                f"Found array with 0 feature(s) (shape={X.shape}) while a minimum of "
                f"1 is required ({name})."
            )
        return X
    dtype = getattr(X, "dtype", None)
    if dtype is None:
        dtype = np.asarray(X).dtype
    if np.dtype(dtype).kind == "c":
        raise ValueError(
            f"Complex data not supported: {name} holds complex numbers; features "
            "must be real"
        )
    try:
        checked = check_array(
            X, accept_sparse=True, dtype=None, ensure_all_finite=False, input_name=name
        )
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from error
    if sparse.issparse(checked) and checked.format not in ("csr", "csc"):
        return checked.tocsr()
    return checked


def _missing(labels: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    if labels.dtype.kind == "f":
        return np.asarray(np.isnan(labels))
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


def check_labels(y: Any, n: int, owner: str) -> npt.NDArray[Any]:
    """``y`` as a 1-D array of ``n`` labels with none missing, or raise ValueError."""
    if y is None:
        raise ValueError(f"{owner} requires y to be passed, but the target y is None.")
    labels = column_or_1d(y, warn=True)
    if labels.shape[0] != n:
        raise ValueError(f"y has {labels.shape[0]} labels for {n} samples of X")
    missing = _missing(labels)
    if missing.any():
        raise ValueError(
            f"Input y contains NaN: {int(missing.sum())} missing label(s) (NaN, None "
            "or pandas.NA); drop or impute those rows, a missing label is no class"
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


def encode_labels(y: Any, n: int, owner: str) -> tuple[npt.NDArray[Any], IntArray]:
    """The sorted classes of ``y`` and each label's index among them."""
    labels = check_labels(y, n, owner)
    try:
        classes, encoded = np.unique(labels, return_inverse=True)
    except TypeError as error:
        raise TypeError(
            f"y mixes label types that cannot be ordered ({error}); use one type"
        ) from error
    return classes, encoded.astype(np.int64).ravel()


def encode_with(classes: npt.NDArray[Any], y: Any, n: int, owner: str) -> IntArray:
    """Indices of the labels ``y`` among the fitted ``classes``, or raise ValueError."""
    labels = check_labels(y, n, owner)
    try:
        unseen = np.setdiff1d(labels, classes)
    except TypeError as error:
        raise TypeError(
            f"y holds labels of another type than the fitted classes ({error})"
        ) from error
    if unseen.size:
        raise ValueError(
            f"y holds labels {unseen.tolist()} not seen at fit time "
            f"(classes: {classes.tolist()})"
        )
    return np.searchsorted(classes, labels).astype(np.int64)


def check_classes(classes: Any) -> npt.NDArray[Any]:
    """``classes`` as a sorted 1-D array of at least 2 distinct labels."""
    labels = np.asarray(classes)
    if labels.ndim != 1 or labels.size < 2:
        raise ValueError(
            f"classes must be a 1-d array of at least 2 labels, got shape "
            f"{labels.shape}"
        )
    if np.any(labels[1:] <= labels[:-1]):
        raise ValueError(f"classes must be sorted and distinct, got {labels.tolist()}")
    return labels
