"""Served post-processors: what the MLflow flavours of SSD and RPS share.

A shielded model is saved as an MLflow ``python_function`` model whose
``loader_module`` is the defense's flavour module (:mod:`defenses.ssd.mlflow`,
:mod:`defenses.rps.mlflow`). Its ``data/shield`` folder holds:

* ``state.npz``: the fitted defense as plain arrays (read with
  ``allow_pickle=False``; no code object of the defense is pickled);
* ``config.json``: the request layout (:class:`Layout`) and the defense's settings;
* one MLflow model folder per wrapped model, saved by that model's own flavour
  (``mlflow.sklearn`` with ``predict_proba``, ``mlflow.pytorch``, or any pyfunc
  model copied from its URI), so the user's model is stored the way MLflow users
  already store it.

Requests are checked here before any model sees them (:func:`check_batch`): a
batch must have between 1 and ``Layout.max_rows`` rows, the layout's columns (by
name for a frame; by count for a plain array), numbers only and no NaN or inf. A
refused batch raises :class:`Refusal`, which MLflow's scoring server answers with
a 4xx whose JSON body holds one line (``error_code``, ``message``) and no
traceback; an error inside the wrapped model becomes a one-line 500, with the
details in the server's log only.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd  # type: ignore[import-untyped]
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import BAD_REQUEST, INTERNAL_ERROR

from defenses.checks import check_choice, check_int

logger = logging.getLogger(__name__)

MAX_ROWS = 1024
"""Default limit on the rows of one request."""
DTYPES = ("float64", "float32")
STATE_FILE = "state.npz"
CONFIG_FILE = "config.json"
DATA_DIR = "shield"
KINDS = ("sklearn", "pytorch", "pyfunc")

Scorer = Callable[[npt.NDArray[np.floating[Any]]], Any]


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
    """

    feature_names: tuple[str, ...]
    max_rows: int = MAX_ROWS
    dtype: str = "float64"

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
        return cls(names, max_rows, dtype)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able mapping (see :meth:`from_json`)."""
        out = asdict(self)
        out["feature_names"] = list(self.feature_names)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Layout:
        """The layout :meth:`to_json` wrote (validated)."""
        return cls(
            tuple(data["feature_names"]), int(data["max_rows"]), str(data["dtype"])
        )


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
        values that are not numbers, and NaN or inf.
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
    out: npt.NDArray[np.floating[Any]] = np.ascontiguousarray(values, layout.dtype)
    return out


def guarded(call: Callable[[], Any], what: str) -> Any:
    """``call()``, with any error turned into a one-line 500 (details logged)."""
    try:
        return call()
    except Refusal:
        raise
    except Exception as error:
        logger.exception("%s failed on a checked batch", what)
        raise Refusal(
            f"{what} failed ({type(error).__name__}); see the server log",
            internal=True,
        ) from None


def requirements() -> list[str]:
    """Pinned requirements of a saved model (the versions installed now)."""
    out = []
    for name in ("defense-suite", "mlflow-skinny", "numpy", "pandas", "scikit-learn"):
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    out.append(f"torch=={importlib.metadata.version('torch')}")
    return out


def save_inner(model: Any, directory: Path, method: str = "predict_proba") -> str:
    """Save the wrapped model with its own MLflow flavour; returns the kind.

    A ``torch.nn.Module`` goes through ``mlflow.pytorch`` (its ``pickle`` format:
    the module's class must be importable where the model is loaded), an object with
    ``method`` (default ``predict_proba``) through ``mlflow.sklearn`` (cloudpickle,
    ``method`` as its pyfunc method), a string is a model URI whose files are
    copied (loaded as a pyfunc model).
    """
    import torch

    if isinstance(model, torch.nn.Module):
        import mlflow.pytorch

        mlflow.pytorch.save_model(
            model,
            str(directory),
            serialization_format="pickle",
            pip_requirements=requirements(),
        )
        return "pytorch"
    if hasattr(model, method):
        import mlflow.sklearn

        mlflow.sklearn.save_model(
            model,
            str(directory),
            serialization_format="cloudpickle",
            pyfunc_predict_fn=method,
            pip_requirements=requirements(),
        )
        return "sklearn"
    if isinstance(model, str):
        import mlflow.artifacts

        with tempfile.TemporaryDirectory() as tmp:
            local = mlflow.artifacts.download_artifacts(model, dst_path=tmp)
            shutil.copytree(local, directory)
        return "pyfunc"
    raise TypeError(
        f"the model must be a torch.nn.Module, have {method}, or be an MLflow "
        f"model URI; got {type(model).__name__}"
    )


def load_inner(directory: Path, kind: str, layout: Layout) -> Scorer:
    """A function from a checked (N, d) batch to the model's raw outputs."""
    check_choice("kind", kind, KINDS)
    if kind == "pytorch":
        import mlflow.pytorch
        import torch

        module = mlflow.pytorch.load_model(str(directory), map_location="cpu")
        module.eval()

        def forward(batch: npt.NDArray[np.floating[Any]]) -> Any:
            with torch.no_grad():
                return module(torch.from_numpy(batch))

        return forward
    if kind == "sklearn":
        import mlflow.sklearn

        estimator = mlflow.sklearn.load_model(str(directory))
        if hasattr(estimator, "feature_names_in_"):
            names = list(layout.feature_names)
            return lambda batch: estimator.predict_proba(
                pd.DataFrame(batch, columns=names)
            )
        return lambda batch: estimator.predict_proba(batch)
    import mlflow.pyfunc

    model = mlflow.pyfunc.load_model(str(directory))
    names = list(layout.feature_names)
    return lambda batch: np.asarray(model.predict(pd.DataFrame(batch, columns=names)))


def save_shielded(
    path: str | Path,
    *,
    flavour: str,
    loader_module: str,
    state: Mapping[str, npt.NDArray[Any]],
    config: Mapping[str, Any],
    models: Mapping[str, Any],
    mlflow_model: Any = None,
    metadata: Mapping[str, Any] | None = None,
    method: str = "predict_proba",
) -> None:
    """Write a shielded pyfunc model to ``path`` (see the module docstring).

    ``models`` maps a folder name to a wrapped model (:func:`save_inner`, with
    ``method``); the kinds are recorded in ``config.json`` under ``"models"``.
    """
    import mlflow.pyfunc
    from mlflow.models import Model

    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not empty")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / DATA_DIR
        data.mkdir()
        kinds = {
            name: save_inner(model, data / name, method)
            for name, model in models.items()
        }
        np.savez(data / STATE_FILE, allow_pickle=False, **dict(state))
        text = json.dumps({**dict(config), "models": kinds}, indent=1, sort_keys=True)
        (data / CONFIG_FILE).write_text(text)
        model = Model() if mlflow_model is None else mlflow_model
        if metadata:
            model.metadata = {**(model.metadata or {}), **dict(metadata)}
        version = importlib.metadata.version("defense-suite")
        model.add_flavor(flavour, suite_version=version, data=f"data/{DATA_DIR}")
        mlflow.pyfunc.save_model(
            str(path),
            loader_module=loader_module,
            data_path=str(data),
            mlflow_model=model,
            pip_requirements=requirements(),
        )


def log_shielded(flavour_module: Any, name: str, **kwargs: Any) -> Any:
    """Log with ``flavour_module.save_model`` to the active run (``Model.log``).

    Returns MLflow's ``ModelInfo`` (``model_uri`` to load or serve).
    """
    from mlflow.models import Model

    return Model.log(artifact_path=None, flavor=flavour_module, name=name, **kwargs)


def read_shielded(
    data_path: str | Path,
) -> tuple[dict[str, npt.NDArray[Any]], dict[str, Any]]:
    """The state arrays and the config a saved shielded model holds."""
    folder = Path(data_path)
    with np.load(folder / STATE_FILE, allow_pickle=False) as arrays:
        state = {key: arrays[key] for key in arrays.files}
    config: dict[str, Any] = json.loads((folder / CONFIG_FILE).read_text())
    return state, config
