"""Requests to a served model: their layout, and the checks before any model sees them.

:func:`check_batch` turns what MLflow's scoring server hands a model (a frame, an
array, a mapping of columns) into a checked (N, d) array, or raises a
:class:`Refusal` that the server answers with a 400 and one line. The checks: 1 to
``Layout.max_rows`` rows, the layout's columns, numbers only, no NaN or inf, and
no value beyond the range of the dtype the model computes in
(:func:`input_limit`): a float32 torch module and a scikit-learn tree cast their
input to float32, where 1e308 or 3.5e38 become inf and the model fails.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd  # type: ignore[import-untyped]
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import BAD_REQUEST, INTERNAL_ERROR

from defenses.checks import check_choice, check_int

MAX_ROWS = 1024
"""Default limit on the rows of one request."""
DTYPES = ("float64", "float32")


class Refusal(MlflowException):
    """A request the served model refuses, answered with one line and no traceback.

    MLflow's scoring server rewrites an exception's ``message`` (it prefixes the
    whole input batch); the JSON body is :meth:`serialize_as_json`, which keeps the
    one-line ``reason`` only.
    """

    def __init__(self, reason: str, *, internal: bool = False) -> None:
        self.reason = " ".join(str(reason).split())
        super().__init__(
            self.reason, error_code=INTERNAL_ERROR if internal else BAD_REQUEST
        )

    def serialize_as_json(self) -> str:
        """``{"error_code": ..., "message": <one line>}``."""
        return json.dumps({"error_code": self.error_code, "message": self.reason})


@dataclass(frozen=True)
class Layout:
    """What a request must look like.

    Parameters
    ----------
    feature_names : tuple of str
        The columns, in the order the model takes them. A frame (``dataframe_split``
        or ``dataframe_records``) must have exactly these columns, in any order; an
        array (``inputs`` or ``instances``: a list of rows) must have this many
        columns, in this order.
    max_rows : int
        Largest batch accepted, >= 1.
    dtype : {"float64", "float32"}
        The dtype the wrapped model receives.
    limit : float, optional
        The largest magnitude a value may have: that of the dtype the model
        computes in (default: the largest finite number of ``dtype``). A value
        beyond it would overflow to inf inside the model; it is refused naming its
        row, column and the range.
    """

    feature_names: tuple[str, ...]
    max_rows: int = MAX_ROWS
    dtype: str = "float64"
    limit: float | None = None

    def __post_init__(self) -> None:
        names = self.feature_names
        if not isinstance(names, tuple) or not names:
            raise ValueError(
                f"feature_names must be a non-empty tuple of str, got {names!r}"
            )
        if not all(isinstance(name, str) for name in names):
            raise ValueError(f"feature_names must be strings, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"feature_names must be distinct, got {names!r}")
        check_int("max_rows", self.max_rows, 1)
        check_choice("dtype", self.dtype, DTYPES)
        top = float(np.finfo(self.dtype).max)
        if self.limit is not None and (
            isinstance(self.limit, bool)
            or not isinstance(self.limit, int | float)
            or not 0 < self.limit <= top
        ):
            raise ValueError(
                f"limit must be a number in (0, {top:.8g}] (the range of dtype "
                f"{self.dtype}), got {self.limit!r}"
            )

    @property
    def bound(self) -> float:
        """The largest magnitude accepted: ``limit``, else the dtype's largest."""
        top = float(np.finfo(self.dtype).max)
        return top if self.limit is None else min(float(self.limit), top)

    @property
    def n_features(self) -> int:
        """Number of columns."""
        return len(self.feature_names)

    @classmethod
    def of(
        cls,
        model: Any,
        n_features: int | None,
        feature_names: Any = None,
        max_rows: int = MAX_ROWS,
        dtype: str = "float64",
    ) -> Layout:
        """The layout of ``model``: given names, its ``feature_names_in_`` or 0..d-1."""
        if feature_names is None:
            feature_names = getattr(model, "feature_names_in_", None)
        if feature_names is None:
            if n_features is None:
                n_features = getattr(model, "n_features_in_", None)
            if n_features is None:
                raise ValueError(
                    "the number of features is unknown: pass n_features= or "
                    "feature_names="
                )
            feature_names = [
                str(i) for i in range(check_int("n_features", n_features, 1))
            ]
        names = tuple(str(name) for name in feature_names)
        if n_features is not None and len(names) != n_features:
            raise ValueError(
                f"feature_names has {len(names)} names, but n_features={n_features}"
            )
        return cls(names, max_rows, dtype, input_limit(model, dtype))

    def to_json(self) -> dict[str, Any]:
        """A JSON-able mapping (see :meth:`from_json`)."""
        out = asdict(self)
        out["feature_names"] = list(self.feature_names)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Layout:
        """The layout :meth:`to_json` wrote (validated)."""
        limit = data.get("limit")
        return cls(
            tuple(data["feature_names"]),
            int(data["max_rows"]),
            str(data["dtype"]),
            None if limit is None else float(limit),
        )


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _float32_inside(model: Any, seen: set[int], depth: int = 0) -> bool:
    """Whether ``model`` or an estimator inside it computes in float32.

    scikit-learn's trees (and the forests and boosting ensembles built of them)
    cast their input to float32; a fitted object is searched through its
    attributes, lists, tuples, dicts and object arrays, a few levels deep.
    """
    if depth > 6 or id(model) in seen:
        return False
    seen.add(id(model))
    try:
        from sklearn.tree import BaseDecisionTree
    except ImportError:  # pragma: no cover - scikit-learn is a base dependency
        return False
    if isinstance(model, BaseDecisionTree):
        return True
    if isinstance(model, Mapping):
        items: Any = list(model.values())
    elif isinstance(model, list | tuple):
        items = model
    elif isinstance(model, np.ndarray) and model.dtype == object:
        items = list(model.flat)
    elif hasattr(model, "get_params") or hasattr(model, "predict"):
        items = list(vars(model).values()) if hasattr(model, "__dict__") else []
    else:
        return False
    return any(_float32_inside(item, seen, depth + 1) for item in items)


def input_limit(model: Any, dtype: str = "float64") -> float | None:
    """The largest input magnitude ``model`` computes with without overflow.

    float32's largest finite number for a float32 ``dtype``, a torch module with
    float32 (or smaller) parameters, or a scikit-learn model with a tree inside;
    None (the dtype's own range) otherwise.
    """
    if dtype == "float32":
        return FLOAT32_MAX
    torch = sys.modules.get("torch")  # a torch module implies torch is imported
    if torch is not None and isinstance(model, torch.nn.Module):
        first = next(iter(model.parameters()), None)
        if first is not None and first.dtype != torch.float64:
            return FLOAT32_MAX
        return None
    return FLOAT32_MAX if _float32_inside(model, set()) else None


def _shown(values: Any, limit: int = 5) -> str:
    items = [str(v) for v in list(values)[:limit]]
    more = len(list(values)) - limit
    return "[" + ", ".join(items) + (f", ... {more} more" if more > 0 else "") + "]"


def _frame_values(frame: Any, layout: Layout) -> npt.NDArray[Any]:
    columns = [str(c) for c in frame.columns]
    if len(set(columns)) != len(columns):
        raise Refusal("the batch has repeated column names")
    missing = [name for name in layout.feature_names if name not in columns]
    unexpected = [name for name in columns if name not in layout.feature_names]
    if missing or unexpected:
        raise Refusal(
            f"wrong columns: missing {_shown(missing)}, unexpected "
            f"{_shown(unexpected)}; expected {_shown(layout.feature_names)}"
        )
    frame = frame.set_axis(columns, axis=1)[list(layout.feature_names)]
    for name in layout.feature_names:
        kind = frame[name].dtype.kind
        if kind not in "iuf":
            raise Refusal(
                f"column {name!r} must hold numbers, got dtype {frame[name].dtype}"
            )
    values: npt.NDArray[Any] = frame.to_numpy(np.float64)
    return values


def _array_values(array: Any, layout: Layout) -> npt.NDArray[Any]:
    if array.dtype.kind not in "iuf":
        raise Refusal(f"the batch must hold numbers, got dtype {array.dtype}")
    if array.ndim != 2 or array.shape[1] != layout.n_features:
        raise Refusal(
            f"the batch must be a list of rows of {layout.n_features} numbers, got "
            f"shape {tuple(array.shape)}"
        )
    return np.asarray(array, dtype=np.float64)


def _rows(model_input: Any) -> int:
    shape = getattr(model_input, "shape", None)
    if shape is None or len(shape) == 0:
        raise Refusal("the batch must be a list of rows, got a single value")
    return int(shape[0])


def check_batch(model_input: Any, layout: Layout) -> npt.NDArray[np.floating[Any]]:
    """The request as a (N, d) array in ``layout.dtype``, or a :class:`Refusal`.

    Accepts what MLflow's server hands a model: a :class:`pandas.DataFrame`
    (``dataframe_split``, ``dataframe_records``), an array (``inputs``,
    ``instances``) or a mapping of columns (``inputs`` as an object); in Python,
    also a list of rows.

    Raises
    ------
    Refusal
        For an empty batch, more than ``layout.max_rows`` rows, wrong columns,
        values that are not numbers, NaN or inf, and values beyond
        ``layout.bound`` (the range of the dtype the model computes in).
    """
    if isinstance(model_input, Mapping):
        try:
            model_input = pd.DataFrame(
                {key: np.asarray(value) for key, value in model_input.items()}
            )
        except ValueError as error:
            raise Refusal(f"the columns must have equal lengths: {error}") from None
    elif isinstance(model_input, list | tuple):
        try:
            model_input = np.asarray(model_input)
        except ValueError:
            raise Refusal("the batch must be rows of equal length") from None
    if not isinstance(model_input, pd.DataFrame | np.ndarray):
        raise Refusal(
            f"the batch must be a table or a list of rows, got "
            f"{type(model_input).__name__}"
        )
    n = _rows(model_input)
    if n == 0:
        raise Refusal("the batch is empty: send at least one row")
    if n > layout.max_rows:
        raise Refusal(f"the batch has {n} rows; the limit is {layout.max_rows} rows")
    if isinstance(model_input, pd.DataFrame):
        values = _frame_values(model_input, layout)
    else:
        values = _array_values(model_input, layout)
    bad = ~np.isfinite(values)
    if bad.any():
        row, column = np.argwhere(bad)[0]
        raise Refusal(
            f"row {row}, column {layout.feature_names[column]!r} is "
            f"{values[row, column]} (only finite numbers are accepted)"
        )
    bound = layout.bound
    beyond = np.abs(values) > bound
    if beyond.any():
        row, column = np.argwhere(beyond)[0]
        raise Refusal(
            f"row {row}, column {layout.feature_names[column]!r} is "
            f"{values[row, column]:.8g}, outside the model's range "
            f"[{-bound:.8g}, {bound:.8g}]"
        )
    out: npt.NDArray[np.floating[Any]] = np.ascontiguousarray(values, layout.dtype)
    return out
