r"""MAPIE 1.x's ``conformity_score`` and ``prefit``, where their meaning carries over.

RPS keeps a class when its conformity score reaches a calibrated threshold,
:math:`C(x) = \{y : s(x, y) \ge \tau\}`: MAPIE's ``"lac"`` score
(``LACConformityScore``, the set :math:`\{y : 1 - \hat p_y(x) \le \hat q\}`), with
:math:`s` the model's probability (one training part) or the softmax of the part
votes. Its certificate bounds how far :math:`s(x, y)` and :math:`\tau` can move
when votes change. MAPIE's ``"aps"``, ``"raps"`` and ``"top_k"`` build sets from
cumulative or rank-based scores (and APS from a random tie-break) that the
certificate does not bound, so they are refused, as is any other
``BaseClassificationScore``, in MAPIE's own words.

``prefit=True`` means what it means in MAPIE's ``SplitConformalClassifier``: the
estimator is already fitted, :meth:`fit` must be skipped, and ``conformalize`` comes
directly after instantiation. A fitted model is one training part, so it needs
``n_train_parts=1`` (no training-poisoning certificate: one poisoned point may
change the only model); the calibration side (``n_calib_parts``) still applies.
:class:`PrefitPart` presents the user's model as that part: its ``predict_proba``
columns reordered to the sorted ``classes_`` and its labels encoded ``0..K-1``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted

from defenses.arrays import FloatArray, IntArray
from defenses.rps.inputs import check_classes

ConformityScore = str
SUPPORTED = ("lac",)
MAPIE_SCORES = ("lac", "top_k", "aps", "raps")

PREFIT_FIT_MESSAGE = (
    "The fit method must be skipped when the prefit parameter is set to True. "
    "Use the conformalize method directly after instanciation."
)
"""MAPIE 1.x's own message (``_raise_error_if_fit_called_in_prefit_mode``)."""


def _refusal(name: str) -> ValueError:
    return ValueError(
        f"conformity_score={name} is not supported by RPS: its certificate bounds "
        "a threshold on s(x, y), MAPIE's 'lac' score (sets {y : s(x, y) >= tau}); "
        "'aps', 'raps' and 'top_k' rank classes by cumulative or rank-based scores "
        "the certificate does not bound. Allowed: 'lac' or LACConformityScore()"
    )


def check_conformity_score(value: Any) -> ConformityScore:
    """``"lac"`` for MAPIE's LAC score (name or instance), or raise ValueError."""
    if isinstance(value, str):
        if value in SUPPORTED:
            return value
        if value in MAPIE_SCORES:
            raise _refusal(repr(value))
        raise ValueError(
            f"Invalid conformity_score parameter: {value!r}; RPS accepts 'lac' "
            "(MAPIE 1.x also names 'top_k', 'aps' and 'raps', which RPS refuses)"
        )
    kind = type(value)
    if kind.__name__ == "LACConformityScore" and kind.__module__.startswith("mapie."):
        return "lac"
    if any(base.__name__ == "BaseClassificationScore" for base in kind.__mro__):
        raise _refusal(f"{kind.__name__}()")
    raise ValueError(
        f"Invalid conformity_score parameter: {value!r}; RPS accepts 'lac' or "
        "MAPIE's LACConformityScore()"
    )


def check_prefit(value: Any) -> bool:
    """``prefit`` as a bool, or raise TypeError."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"prefit must be a bool, got {value!r}")
    return bool(value)


class PrefitPart:
    """A user's fitted classifier seen as RPS's one training part.

    Parameters
    ----------
    model : fitted classifier with ``predict_proba`` and ``classes_``
        Used as it is, never refitted.

    Attributes
    ----------
    labels : ndarray of shape (K,)
        The model's classes, sorted (RPS's ``classes_``).
    classes_ : int ndarray
        ``0..K-1``: the part's encoded labels.
    """

    def __init__(self, model: Any) -> None:
        name = type(model).__name__
        try:
            check_is_fitted(model)
        except NotFittedError as error:
            raise NotFittedError(
                f"prefit=True needs a fitted estimator, but this {name} is not "
                "fitted: fit it first (clone() unfits a prefit estimator; wrap it in "
                "sklearn.frozen.FrozenEstimator to keep it through clone)"
            ) from error
        if not callable(getattr(model, "predict_proba", None)):
            raise TypeError(
                f"prefit=True needs an estimator with predict_proba (the LAC score), "
                f"got {name}"
            )
        if getattr(model, "classes_", None) is None:
            raise TypeError(f"prefit=True needs the estimator's classes_, got {name}")
        given = np.asarray(model.classes_)
        self._order: IntArray = np.argsort(given, kind="stable").astype(np.int64)
        self.labels: npt.NDArray[Any] = check_classes(given[self._order])
        self.model = model
        self.classes_: IntArray = np.arange(self.labels.size, dtype=np.int64)

    def predict_proba(self, X: Any) -> FloatArray:
        """The model's probabilities, columns in sorted-label order."""
        proba = np.asarray(self.model.predict_proba(X), dtype=np.float64)
        if proba.ndim != 2 or proba.shape[1] != self.labels.size:
            raise ValueError(
                f"the prefit estimator's predict_proba returned shape {proba.shape}, "
                f"expected (n, {self.labels.size}) for its classes_"
            )
        return np.asarray(proba[:, self._order])

    def predict(self, X: Any) -> IntArray:
        """Encoded labels of highest probability."""
        return np.asarray(self.predict_proba(X).argmax(axis=1), dtype=np.int64)
