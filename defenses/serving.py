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

The files are sealed at save: the SHA-256 of every file under ``data/shield``
is recorded in the model's ``MLmodel`` file (the flavour's ``digests``), and
``config.json`` records each state array's shape and dtype. :func:`read_shielded`
checks both before anything is parsed or unpickled, and refuses a model whose
files were changed, added or removed after saving, naming the file (an edited
threshold, swapped prototype rows, another epsilon, a replaced model pickle). The
digests detect changes made without rewriting ``MLmodel``; they are not a
signature: whoever may write all the files can also rewrite the digests.

Requests are checked before any model sees them
(:func:`~defenses.serving_request.check_batch`): a batch must have between 1 and
``Layout.max_rows`` rows, the layout's columns (by name for a frame; by count for a
plain array), numbers only, no NaN or inf, and no value beyond the range of the
dtype the model computes in (``Layout.limit``: 3.4e38 for a float32 torch module or
a scikit-learn tree model, which cast their input to float32). A refused batch
raises :class:`Refusal`, which MLflow's scoring server answers with a 4xx whose
JSON body holds one line (``error_code``, ``message``) and no traceback; an error
inside the wrapped model becomes a one-line 500, with the details in the server's
log only.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd  # type: ignore[import-untyped]

from defenses.checks import check_choice
from defenses.serving_request import (
    DTYPES,
    FLOAT32_MAX,
    MAX_ROWS,
    Layout,
    Refusal,
    check_batch,
    input_limit,
)
from defenses.serving_seal import (
    StateError,
    check_state_layout,
    digests,
    state_layout,
    verify_digests,
)

__all__ = [
    "CONFIG_FILE",
    "DATA_DIR",
    "DIGESTS",
    "DTYPES",
    "FLOAT32_MAX",
    "KINDS",
    "MAX_ROWS",
    "STATE_FILE",
    "STATE_LAYOUT",
    "Layout",
    "Refusal",
    "StateError",
    "check_batch",
    "check_output_width",
    "guarded",
    "input_limit",
    "load_inner",
    "log_shielded",
    "read_shielded",
    "requirements",
    "save_inner",
    "save_shielded",
]

logger = logging.getLogger(__name__)

STATE_FILE = "state.npz"
CONFIG_FILE = "config.json"
DATA_DIR = "shield"
KINDS = ("sklearn", "pytorch", "pyfunc")
DIGESTS = "digests"
"""The key of the flavour's ``MLmodel`` entry holding the files' SHA-256 digests."""
STATE_LAYOUT = "state_layout"
"""The ``config.json`` key recording each state array's shape and dtype."""

Scorer = Callable[[npt.NDArray[np.floating[Any]]], Any]


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


def check_output_width(scorer: Scorer, layout: Layout, width: int, where: str) -> None:
    """Refuse a wrapped model whose answer to one row is not ``(1, width)``.

    The consistency of a loaded model with the defense saved beside it: a shield
    fitted on K classes (prototypes (K, K)) wraps a model with K outputs. The probe
    is one row of zeros in the layout's dtype.

    Raises
    ------
    StateError
        Naming ``where`` (the model's folder), the shape it answered and ``width``.
    """
    probe = np.zeros((1, layout.n_features), dtype=layout.dtype)
    try:
        shape = tuple(np.shape(np.asarray(scorer(probe))))
    except Exception as error:
        raise StateError(
            f"{where}: the wrapped model fails on one row of zeros "
            f"({type(error).__name__}: {error})"
        ) from None
    if shape != (1, width):
        raise StateError(
            f"{where}: the wrapped model answers shape {shape} for one row; the "
            f"saved defense was made for {width} classes, (1, {width})"
        )


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
        recorded = {**dict(config), "models": kinds, STATE_LAYOUT: state_layout(state)}
        text = json.dumps(recorded, indent=1, sort_keys=True)
        (data / CONFIG_FILE).write_text(text)
        model = Model() if mlflow_model is None else mlflow_model
        if metadata:
            model.metadata = {**(model.metadata or {}), **dict(metadata)}
        version = importlib.metadata.version("defense-suite")
        model.add_flavor(
            flavour,
            suite_version=version,
            data=f"data/{DATA_DIR}",
            **{DIGESTS: digests(data, f"data/{DATA_DIR}")},
        )
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
    """The state arrays and the config a saved shielded model holds, checked.

    ``data_path`` is the model's ``data/shield`` folder. Before anything is parsed,
    every file under it is checked against the digests recorded in the model's
    ``MLmodel`` at save (:func:`~defenses.serving_seal.verify_digests`); then the
    state arrays against the names, shapes and dtypes ``config.json`` recorded.

    Raises
    ------
    StateError
        Naming the file or array that differs from what was saved.
    """
    folder = Path(data_path)
    prefix = f"data/{DATA_DIR}"
    verify_digests(folder, prefix, _recorded_digests(folder.parents[1], prefix))
    with np.load(folder / STATE_FILE, allow_pickle=False) as arrays:
        state = {key: arrays[key] for key in arrays.files}
    config: dict[str, Any] = json.loads((folder / CONFIG_FILE).read_text())
    check_state_layout(state, config.get(STATE_LAYOUT), f"{prefix}/{STATE_FILE}")
    return state, config


def _recorded_digests(root: Path, prefix: str) -> Any:
    """The digests the ``MLmodel`` in ``root`` recorded for ``prefix`` (or None)."""
    from mlflow.models import Model

    if not (root / "MLmodel").is_file():
        return None
    for name, entry in Model.load(str(root / "MLmodel")).flavors.items():
        if name != "python_function" and entry.get("data") == prefix:
            return entry.get(DIGESTS)
    return None
