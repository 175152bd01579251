"""The boundary of the RPS estimator: inputs checked, never converted.

Features are handed to the part estimators as the user gave them (a DataFrame with
string columns for a ``Pipeline``, a sparse matrix, NaN for an estimator that
accepts it); this module only checks what every estimator needs (two dimensions, at
least one sample and one feature), turns lists into arrays and sparse formats
without row indexing (COO, DIA, DOK, BSR, LIL) into CSR. Labels of any type
(checked by :func:`defenses.targets.check_labels`: a missing label is refused, since
it is no class) are encoded into ``0..K-1`` against the sorted classes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import sparse
from sklearn.utils.validation import check_array

from defenses.arrays import IntArray
from defenses.rps.partition import is_frame
from defenses.targets import check_labels


def check_inputs(X: Any, name: str = "X") -> Any:
    """``X`` itself (a DataFrame, sparse matrix or array), or an array for a list.

    Raises
    ------
    ValueError
        If ``X`` is not two-dimensional or has no sample or no feature (messages as
        scikit-learn's ``check_array``).
    """
    if (
        type(X) is np.ndarray
        and X.ndim == 2
        and X.dtype.kind in "biuf"
        and X.shape[0] >= 1
        and X.shape[1] >= 1
    ):
        return X  # what check_array returns for it (no copy, no conversion)
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


def encode_labels(y: Any, n: int, owner: str) -> tuple[npt.NDArray[Any], IntArray]:
    """The sorted classes of ``y`` and each label's index among them."""
    labels = check_labels(y, owner, n)
    try:
        classes, encoded = np.unique(labels, return_inverse=True)
    except TypeError as error:
        raise TypeError(
            f"y mixes label types that cannot be ordered ({error}); use one type"
        ) from error
    return classes, encoded.astype(np.int64).ravel()


def encode_with(classes: npt.NDArray[Any], y: Any, n: int, owner: str) -> IntArray:
    """Indices of the labels ``y`` among the fitted ``classes``, or raise ValueError."""
    labels = check_labels(y, owner, n)
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
