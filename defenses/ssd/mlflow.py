r"""SSD as an MLflow model: log a shielded model, serve it with ``mlflow models serve``.

:func:`save_model` / :func:`log_model` store a shielded model as an MLflow
``python_function`` model (flavour ``defenses_ssd``, loader module this one): the
user's model in its own MLflow flavour (``mlflow.sklearn``, ``mlflow.pytorch``, or
any pyfunc model given by URI) and the fitted :class:`~defenses.ssd.defense.
StealthyShield` as arrays (:func:`~defenses.ssd.state.shield_state`: prototypes,
settings, key), never as pickled code (see :mod:`defenses.serving`)::

    info = defenses.ssd.mlflow.log_model(shielded_classifier, name="model")
    model = mlflow.pyfunc.load_model(info.model_uri)
    model.predict(frame)        # (N, K) defended probabilities, columns = classes

The answer to a batch is the (N, K) array of defended probabilities :math:`p^\star`,
column :math:`j` for class ``classes[j]`` (the list is in the model's ``MLmodel``
metadata, ``ssd_classes``). Under ``seeding="input-hash"`` the pseudo-label of a row
is a keyed hash of the row *as the model receives it* (float64 for scikit-learn,
the module's dtype for torch), so a row gets the same answer from every worker,
every restart and every request format; the key is the one fitted, stored in the
model's files (keep them as secret as the weights). Under ``seeding="random"`` each
loaded copy (each server worker) draws a fresh key from the operating system's
entropy, so no two workers and no two restarts replay one stream; calls in one
process are serialised by a lock so that concurrent requests never share draws.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from defenses.serving import (
    MAX_ROWS,
    Layout,
    check_batch,
    check_output_width,
    guarded,
    load_inner,
    log_shielded,
    read_shielded,
    save_shielded,
)
from defenses.ssd.defense import StealthyShield
from defenses.ssd.lazy import check_outputs
from defenses.ssd.sklearn import ShieldedClassifier
from defenses.ssd.state import load_shield_state, shield_state
from defenses.ssd.torch import ShieldedModule, to_probs

FLAVOUR = "defenses_ssd"
MODEL = "model"


def _parts(
    shielded: Any, shield: StealthyShield | None, outputs: str
) -> tuple[Any, StealthyShield, str]:
    """(the user's model, the fitted shield, what the model returns)."""
    if isinstance(shielded, ShieldedClassifier):
        if not hasattr(shielded, "shield_"):
            raise ValueError("the ShieldedClassifier is not fitted: call fit first")
        return shielded.estimator_, shielded.shield_, "probs"
    if isinstance(shielded, ShieldedModule):
        if not isinstance(shielded.shield, StealthyShield):
            raise TypeError("the ShieldedModule's shield must be a StealthyShield")
        kind = "auto" if shielded.auto and shielded.outputs == "logits" else None
        return shielded.model, shielded.shield, kind or shielded.outputs
    if not isinstance(shield, StealthyShield):
        raise TypeError(
            "give a fitted ShieldedClassifier or ShieldedModule, or a model (torch "
            "module, predict_proba model or MLflow model URI) with shield= a fitted "
            f"StealthyShield; got {type(shielded).__name__} and shield={shield!r}"
        )
    return shielded, shield, check_outputs(outputs)


def save_model(
    shielded: Any,
    path: str | Path,
    *,
    shield: StealthyShield | None = None,
    outputs: str = "probs",
    n_features: int | None = None,
    feature_names: Any = None,
    classes: Any = None,
    max_rows: int = MAX_ROWS,
    mlflow_model: Any = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Save a shielded model as an MLflow pyfunc model in the empty folder ``path``.

    Parameters
    ----------
    shielded : ShieldedClassifier, ShieldedModule, torch module, classifier or str
        A fitted :class:`~defenses.ssd.sklearn.ShieldedClassifier` or a
        :class:`~defenses.ssd.torch.ShieldedModule`; or the user's model (a torch
        module, an object with ``predict_proba``, or an MLflow model URI whose pyfunc
        ``predict`` returns (N, K) outputs) with ``shield``.
    shield : StealthyShield, optional
        The fitted shield, when ``shielded`` is a bare model.
    outputs : {"probs", "logits", "log-probs", "auto"}
        What a bare model returns (a shielded wrapper knows its own).
    n_features, feature_names : optional
        The request columns (:class:`~defenses.serving.Layout`); read from the
        estimator's ``feature_names_in_`` / ``n_features_in_`` when it has them. A
        torch module needs one of them.
    classes : sequence, optional
        Class labels of the K columns (default: the estimator's ``classes_``, else
        0..K-1).
    max_rows : int
        Largest batch a request may send (default :data:`~defenses.serving.MAX_ROWS`).
    mlflow_model, metadata
        As in MLflow's ``save_model`` (``mlflow_model`` is passed by :func:`log_model`).
    """
    model, fitted, kind = _parts(shielded, shield, outputs)
    state = shield_state(fitted)
    n_classes = int(state["prototypes"].shape[0])
    if classes is None:
        classes = getattr(model, "classes_", np.arange(n_classes))
    labels = np.asarray(classes).tolist()
    if len(labels) != n_classes:
        raise ValueError(
            f"classes has {len(labels)} labels; the shield has {n_classes} classes"
        )
    dtype = "float64"
    if isinstance(model, torch.nn.Module):
        first = next(iter(model.parameters()), None)
        dtype = "float32" if first is None else str(first.dtype).split(".")[-1]
        dtype = dtype if dtype in ("float32", "float64") else "float32"
    layout = Layout.of(model, n_features, feature_names, max_rows, dtype)
    save_shielded(
        path,
        flavour=FLAVOUR,
        loader_module=__name__,
        state=state,
        config={"layout": layout.to_json(), "outputs": kind, "classes": labels},
        models={MODEL: model},
        mlflow_model=mlflow_model,
        metadata={**(metadata or {}), "ssd_classes": labels},
    )


def log_model(shielded: Any, name: str = "model", **kwargs: Any) -> Any:
    """Log a shielded model to the active run; returns MLflow's ``ModelInfo``.

    ``kwargs`` go to :func:`save_model` (and MLflow's ``Model.log``:
    ``registered_model_name``, ``tags``...).
    """
    return log_shielded(sys.modules[__name__], name, shielded=shielded, **kwargs)


class ServedShield:
    """The loaded model: checks a batch, runs the user's model, shields the answer.

    Built by :func:`_load_pyfunc`; MLflow wraps it in a ``PyFuncModel``.
    """

    def __init__(
        self,
        scorer: Any,
        shield: StealthyShield,
        layout: Layout,
        outputs: str,
        classes: list[Any],
    ) -> None:
        self.scorer = scorer
        self.shield = shield
        self.layout = layout
        self.outputs = check_outputs(outputs)
        self.classes = classes
        self._lock = threading.Lock()

    def _probs(self, raw: Any) -> npt.NDArray[np.float64]:
        values = (
            raw
            if isinstance(raw, torch.Tensor)
            else torch.from_numpy(np.asarray(raw, dtype=np.float64))
        )
        probs: npt.NDArray[np.float64] = to_probs(values, self.outputs).numpy()
        return probs

    def predict(
        self, model_input: Any, params: dict[str, Any] | None = None
    ) -> npt.NDArray[np.floating[Any]]:
        """Defended probabilities (N, K) of a checked batch (``params`` unused)."""
        batch = check_batch(model_input, self.layout)
        raw = guarded(lambda: self.scorer(batch), "the model")
        probs = guarded(lambda: self._probs(raw), "reading the model's outputs")
        with self._lock:
            answers: npt.NDArray[np.floating[Any]] = guarded(
                lambda: self.shield(probs, inputs=batch), "the shield"
            )
        return answers


def load_shield(state: dict[str, npt.NDArray[Any]]) -> StealthyShield:
    """The stored shield; under random seeding with a fresh key from OS entropy."""
    shield: StealthyShield = load_shield_state(StealthyShield(), state)
    if shield.seeding == "random":
        shield.key_ = np.random.default_rng().integers(
            0, 2**64, dtype=np.uint64, endpoint=False
        )
        shield.counter_ = np.uint64(0)
    return shield


def _load_pyfunc(data_path: str, model_config: Any = None) -> ServedShield:
    """MLflow's entry point: the model in ``data_path`` (the ``data`` folder)."""
    folder = Path(data_path)
    state, config = read_shielded(folder)
    layout = Layout.from_json(config["layout"])
    scorer = load_inner(folder / MODEL, config["models"][MODEL], layout)
    check_output_width(scorer, layout, len(config["classes"]), f"data/shield/{MODEL}")
    return ServedShield(
        scorer, load_shield(state), layout, config["outputs"], config["classes"]
    )
