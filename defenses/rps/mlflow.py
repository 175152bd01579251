r"""RPS prediction sets as an MLflow model: log, load, serve with MLflow's server.

:func:`save_model` / :func:`log_model` store a fitted and conformalized
:class:`~defenses.rps.defense.ReliableConformalClassifier` as an MLflow
``python_function`` model (flavour ``defenses_rps``, loader module this one): each of
the :math:`k_t` part classifiers in ``mlflow.sklearn``'s format (a part that
predicts one class everywhere is stored as that class), and the conformal state
(the per-part thresholds and their bounds, :math:`\hat\tau`, the part sizes, the
classes and the settings: every public fitted attribute) as arrays and JSON, never
as pickled code (see :mod:`defenses.serving`).

The answer to a batch of N rows is a :class:`pandas.DataFrame` with N rows and the
columns

* ``prediction``: the point prediction (the class of highest score, a label from
  ``classes``);
* ``set_size``: the number of classes in the prediction set;
* ``in_set[<label>]``, one per class in ``classes`` order: whether the class is in
  the majority prediction set :math:`\{y : s(x, y) \ge \mathrm{cut}\}`.

With a list of confidence levels, ``set_size@<level>`` and
``in_set[<label>]@<level>`` for each level in turn. Served as JSON, each row is a
record, e.g. ``{"prediction": 2, "set_size": 2, "in_set[0]": false, "in_set[1]":
true, "in_set[2]": true}``. The sets are those of the saved classifier's
:meth:`~defenses.rps.defense.ReliableConformalClassifier.predict_set` on the same
rows, bit for bit; the answer holds no randomness, so every
worker and every restart gives the same answer.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd  # type: ignore[import-untyped]

from defenses.rps.defense import ReliableConformalClassifier
from defenses.rps.ensemble import ConstantClassifier
from defenses.rps.parts import FittedParts
from defenses.rps.state import check_restored
from defenses.serving import (
    MAX_ROWS,
    Layout,
    check_batch,
    guarded,
    log_shielded,
    read_shielded,
    save_shielded,
)

FLAVOUR = "defenses_rps"
SKIPPED = ("estimators_", "voter_")
"""Fitted attributes not stored as state (the parts are models of their own)."""
ALLOWED = "defenses.rps."
"""Dataclasses of the fitted state are rebuilt only from this package's modules."""


def _part(index: int) -> str:
    return f"part_{index:04d}"


def set_columns(classes: list[Any], levels: list[float] | None = None) -> list[str]:
    """The answer's columns: ``prediction``, ``set_size``, ``in_set[<label>]``...

    With several confidence levels, ``set_size@<level>`` and
    ``in_set[<label>]@<level>`` for each level in turn.
    """
    if levels is None:
        return ["prediction", "set_size", *(f"in_set[{c}]" for c in classes)]
    out = ["prediction"]
    for level in levels:
        out += [f"set_size@{level}", *(f"in_set[{c}]@{level}" for c in classes)]
    return out


def _encode(value: Any, name: str, arrays: dict[str, npt.NDArray[Any]]) -> Any:
    """A JSON-able form of a fitted value; arrays go to ``arrays`` under ``name``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        if value.dtype == object and all(isinstance(v, str) for v in value.flat):
            arrays[name] = value.astype(str)  # feature names: strings, kept as objects
            return {"array": name, "object": True}
        if value.dtype.kind not in "biufU":
            raise TypeError(f"{name}: arrays of {value.dtype} cannot be stored")
        arrays[name] = value
        return {"array": name}
    if isinstance(value, list | tuple):
        items = [_encode(v, f"{name}.{i}", arrays) for i, v in enumerate(value)]
        return {"tuple" if isinstance(value, tuple) else "list": items}
    kind = type(value)
    if dataclasses.is_dataclass(value) and kind.__module__.startswith(ALLOWED):
        fields = {
            f.name: _encode(getattr(value, f.name), f"{name}.{f.name}", arrays)
            for f in dataclasses.fields(value)
        }
        return {"dataclass": f"{kind.__module__}:{kind.__qualname__}", "fields": fields}
    raise TypeError(f"{name}: a fitted {kind.__name__} cannot be stored")


def _decode(value: Any, arrays: dict[str, npt.NDArray[Any]]) -> Any:
    """The value :func:`_encode` wrote."""
    if not isinstance(value, dict):
        return value
    if "array" in value:
        array = arrays[value["array"]]
        return array.astype(object) if value.get("object") else array
    if "list" in value:
        return [_decode(v, arrays) for v in value["list"]]
    if "tuple" in value:
        return tuple(_decode(v, arrays) for v in value["tuple"])
    module, _, qualname = str(value["dataclass"]).partition(":")
    if not module.startswith(ALLOWED):
        raise ValueError(f"state: {module} is not a module of {ALLOWED[:-1]}")
    kind = getattr(importlib.import_module(module), qualname)
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        raise ValueError(f"state: {module}:{qualname} is not a dataclass")
    return kind(**{k: _decode(v, arrays) for k, v in value["fields"].items()})


def _params(rps: ReliableConformalClassifier) -> dict[str, Any]:
    params = dict(rps.get_params(deep=False))
    params.pop("estimator")
    params["n_jobs"] = None
    if not isinstance(params.get("conformity_score", "lac"), str):
        params["conformity_score"] = "lac"  # MAPIE's LAC object: the same score
    if isinstance(params.get("confidence_level"), tuple | np.ndarray):
        params["confidence_level"] = [float(v) for v in params["confidence_level"]]
    return params


def save_model(
    rps: ReliableConformalClassifier,
    path: str | Path,
    *,
    feature_names: Any = None,
    max_rows: int = MAX_ROWS,
    mlflow_model: Any = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Save a conformalized RPS classifier as an MLflow pyfunc model in ``path``.

    Parameters
    ----------
    rps : ReliableConformalClassifier
        Fitted by :meth:`~defenses.rps.defense.ReliableConformalClassifier.fit`
        (scikit-learn part classifiers) and conformalized.
    feature_names : sequence of str, optional
        The request columns (default: the ``feature_names_in_`` seen by ``fit``,
        else ``"0"``..``"d-1"``).
    max_rows : int
        Largest batch a request may send.
    mlflow_model, metadata
        As in MLflow's ``save_model`` (``mlflow_model`` is passed by :func:`log_model`).

    Raises
    ------
    ValueError
        If ``rps`` is not fitted or not conformalized, was built from a voter or
        with ``prefit=True`` (its parts live elsewhere: not supported here).
    """
    if not isinstance(rps, ReliableConformalClassifier):
        raise TypeError(
            f"rps must be a ReliableConformalClassifier, got {type(rps).__name__}"
        )
    if hasattr(rps, "voter_") or getattr(rps, "prefit", False):
        raise ValueError(
            "an RPS classifier built from a voter or with prefit=True cannot be "
            "saved by this flavour: its parts are not its own fitted estimators"
        )
    if not hasattr(rps, "estimators_") or not hasattr(rps, "part_thresholds_"):
        raise ValueError("rps must be fitted and conformalized before it is saved")
    models, constants = {}, {}
    for index, part in enumerate(rps.estimators_):
        if isinstance(part, ConstantClassifier):
            constants[_part(index)] = int(part.label)
        else:
            models[_part(index)] = part
    arrays: dict[str, npt.NDArray[Any]] = {}
    fitted = {
        name: _encode(value, name, arrays)
        for name, value in vars(rps).items()
        if name.endswith("_") and not name.startswith("_") and name not in SKIPPED
    }
    labels = np.asarray(rps.classes_).tolist()
    levels = rps.get_params()["confidence_level"]
    several = None if np.ndim(levels) == 0 else [float(v) for v in levels]
    config = {
        "layout": Layout.of(rps, None, feature_names, max_rows).to_json(),
        "params": _params(rps),
        "fitted": fitted,
        "n_parts": len(rps.estimators_),
        "constants": constants,
        "columns": set_columns(labels, several),
    }
    save_shielded(
        path,
        flavour=FLAVOUR,
        loader_module=__name__,
        state=arrays,
        config=config,
        models=models,
        mlflow_model=mlflow_model,
        metadata={**(metadata or {}), "rps_columns": config["columns"]},
        method="predict",
    )


def log_model(
    rps: ReliableConformalClassifier, name: str = "model", **kwargs: Any
) -> Any:
    """Log a conformalized RPS classifier to the active run (MLflow's ``ModelInfo``)."""
    return log_shielded(sys.modules[__name__], name, rps=rps, **kwargs)


def restore(
    state: dict[str, npt.NDArray[Any]], config: dict[str, Any], parts: list[Any]
) -> ReliableConformalClassifier:
    """The conformalized classifier from its stored state and its loaded parts.

    Raises ValueError, naming the attribute, for a state that is not one
    classifier's for these parts (:func:`~defenses.rps.state.check_restored`).
    """
    rps = ReliableConformalClassifier(None, **config["params"])
    for name, value in config["fitted"].items():
        setattr(rps, name, _decode(value, state))
    check_restored(rps, parts)
    rps.estimators_ = parts
    rps._parts = FittedParts(parts, None, int(np.asarray(rps.classes_).size))
    return rps


class ServedSets:
    """The loaded model: checks a batch and answers its prediction sets."""

    def __init__(
        self, rps: ReliableConformalClassifier, layout: Layout, columns: list[str]
    ) -> None:
        self.rps = rps
        self.layout = layout
        self.columns: list[str] = list(columns)
        self._named = hasattr(rps, "feature_names_in_")
        self._lock = threading.Lock()

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        """The sets of a checked batch (``params`` unused), as documented above."""
        batch = check_batch(model_input, self.layout)
        features: Any = batch
        if self._named:
            features = pd.DataFrame(batch, columns=list(self.layout.feature_names))
        with self._lock:
            prediction, sets = guarded(
                lambda: self.rps.predict_set(features), "the RPS model"
            )
        values: list[Any] = [prediction]
        for level in range(sets.shape[2]):
            members = sets[:, :, level]
            values += [members.sum(axis=1).astype(np.int64), *members.T]
        return pd.DataFrame(dict(zip(self.columns, values, strict=True)))


def _load_pyfunc(data_path: str, model_config: Any = None) -> ServedSets:
    """MLflow's entry point: the model in ``data_path`` (the ``data`` folder)."""
    import mlflow.sklearn

    folder = Path(data_path)
    state, config = read_shielded(folder)
    parts: list[Any] = []
    for index in range(int(config["n_parts"])):
        name = _part(index)
        if name in config["constants"]:
            parts.append(ConstantClassifier(int(config["constants"][name])))
        else:
            parts.append(mlflow.sklearn.load_model(str(folder / name)))
    rps = restore(state, config, parts)
    return ServedSets(rps, Layout.from_json(config["layout"]), config["columns"])
