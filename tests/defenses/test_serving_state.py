"""Served models at the edges: values beyond the model's dtype, and edited saved state.

Through MLflow's own pyfunc load path (``mlflow.pyfunc.load_model``), the path
``mlflow models serve`` takes in each worker; a :class:`Refusal` is what the
scoring server answers with its HTTP status (400 for a request, never a 500).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import make_classification
from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.tree import DecisionTreeClassifier

mlflow = pytest.importorskip("mlflow")

from defenses.rps import ReliableConformalClassifier  # noqa: E402
from defenses.rps import mlflow as rps_mlflow  # noqa: E402
from defenses.serving import (  # noqa: E402
    FLOAT32_MAX,
    Layout,
    Refusal,
    StateError,
    check_batch,
    input_limit,
)
from defenses.serving_seal import reseal  # noqa: E402
from defenses.ssd import mlflow as ssd_mlflow  # noqa: E402
from defenses.ssd.defense import StealthyShield  # noqa: E402
from defenses.ssd.sklearn import ShieldedClassifier  # noqa: E402
from defenses.ssd.torch import ShieldedModule  # noqa: E402

X, Y = make_classification(
    300, 4, n_informative=3, n_redundant=0, n_classes=3, random_state=0
)


def _refusal(call) -> Refusal:
    with pytest.raises(Refusal) as refused:
        call()
    assert refused.value.get_http_status_code() == 400
    message = json.loads(refused.value.serialize_as_json())["message"]
    assert "\n" not in message
    return refused.value


# --- values beyond the dtype the model computes in ----------------------------------


@pytest.mark.parametrize(
    ("model", "limit"),
    [
        (LogisticRegression(), None),
        (DecisionTreeClassifier(), FLOAT32_MAX),
        (RandomForestClassifier(n_estimators=2), FLOAT32_MAX),
        (make_pipeline(StandardScaler(), DecisionTreeClassifier()), FLOAT32_MAX),
        (torch.nn.Linear(4, 3), FLOAT32_MAX),
        (torch.nn.Linear(4, 3).double(), None),
    ],
)
def test_the_limit_is_the_range_of_the_dtype_the_model_computes_in(model, limit):
    assert input_limit(model) == limit


def test_a_fitted_boosting_ensemble_is_found_to_use_float32():
    fitted = GradientBoostingClassifier(n_estimators=2).fit(X, Y)
    assert input_limit(fitted) == FLOAT32_MAX  # its trees sit in an object array


@pytest.mark.parametrize("value", [1e308, -1e308, 3.5e38, -3.5e38])
def test_values_beyond_float32_are_a_400_naming_the_column_and_range(value):
    layout = Layout(("a", "b"), limit=FLOAT32_MAX)
    batch = np.array([[0.0, 1.0], [value, 2.0]])
    refused = _refusal(lambda: check_batch(batch, layout))
    assert "row 1, column 'a'" in refused.reason
    assert "outside the model's range [-3.4028235e+38, 3.4028235e+38]" in refused.reason
    edge = np.array([[FLOAT32_MAX, -FLOAT32_MAX]])
    assert np.isfinite(check_batch(edge, layout)).all()  # the range itself is fine


def test_a_float64_model_takes_1e308():
    assert check_batch(np.array([[1e308, -1e308]]), Layout(("a", "b")))[0, 0] == 1e308
    assert Layout(("a",), dtype="float32").bound == FLOAT32_MAX


def test_the_limit_is_validated_naming_it():
    with pytest.raises(ValueError, match="limit must be a number"):
        Layout(("a",), dtype="float32", limit=1e300)
    with pytest.raises(ValueError, match="limit must be a number"):
        Layout(("a",), limit=0.0)


def _shielded_forest():
    shield = StealthyShield(epsilon=1.0, seed=3, n_threads=1)
    forest = RandomForestClassifier(n_estimators=5, random_state=0)
    return ShieldedClassifier(forest, shield, random_state=0).fit(X, Y)


def test_a_served_tree_model_refuses_1e308_with_a_400(tmp_path):
    ssd_mlflow.save_model(_shielded_forest(), tmp_path / "m")
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "m"))
    rows = X[:3].copy()
    assert loaded.predict(rows).shape == (3, 3)
    rows[2, 1] = 1e308
    refused = _refusal(lambda: loaded.predict(rows))
    assert "row 2, column '1' is 1e+308, outside the model's range" in refused.reason


def test_a_served_float32_torch_module_refuses_3_5e38_with_a_400(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with torch.no_grad():
        val = torch.softmax(net(torch.tensor(X, dtype=torch.float32)), 1).double()
    shield = StealthyShield(epsilon=1.0, seed=5, seeding="input-hash", n_threads=1)
    shield.fit(val.numpy(), Y)
    ssd_mlflow.save_model(ShieldedModule(net, shield), tmp_path / "t", n_features=4)
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "t"))
    rows = X[:2].copy()
    rows[0, 3] = -3.5e38
    refused = _refusal(lambda: loaded.predict(rows))
    assert "row 0, column '3'" in refused.reason


# --- saved state edited after saving --------------------------------------------------


def _saved_ssd(tmp_path: Path) -> Path:
    model = ShieldedClassifier(
        LogisticRegression(max_iter=300), StealthyShield(epsilon=1.0, seed=3)
    )
    ssd_mlflow.save_model(model.fit(X, Y), tmp_path / "m")
    return tmp_path / "m"


def _edit_state(root: Path, change) -> None:
    path = root / "data" / "shield" / "state.npz"
    with np.load(path, allow_pickle=False) as arrays:
        state = {key: arrays[key] for key in arrays.files}
    change(state)
    np.savez(path, allow_pickle=False, **state)


def _swap_rows(state):
    state["prototypes"] = state["prototypes"][[1, 0, 2]]


def _epsilon(state):
    state["settings"] = state["settings"].copy()
    state["settings"][0] = 8.0


@pytest.mark.parametrize("change", [_swap_rows, _epsilon], ids=["swap", "epsilon"])
def test_an_edited_ssd_state_is_refused_naming_the_file(tmp_path, change):
    root = _saved_ssd(tmp_path)
    assert mlflow.pyfunc.load_model(str(root)) is not None
    _edit_state(root, change)
    with pytest.raises(StateError, match=r"^data/shield/state\.npz: its sha256"):
        mlflow.pyfunc.load_model(str(root))


def test_a_replaced_model_pickle_is_refused_before_it_is_unpickled(tmp_path):
    root = _saved_ssd(tmp_path)
    pickle = next((root / "data" / "shield" / "model").glob("*.pkl"))
    pickle.write_bytes(b"not what was saved")
    with pytest.raises(StateError, match=rf"data/shield/model/{pickle.name}: its"):
        mlflow.pyfunc.load_model(str(root))


def test_added_removed_files_and_missing_digests_are_refused(tmp_path):
    root = _saved_ssd(tmp_path)
    extra = root / "data" / "shield" / "extra.json"
    extra.write_text("{}")
    with pytest.raises(StateError, match=r"extra\.json: not among the files recorded"):
        mlflow.pyfunc.load_model(str(root))
    extra.unlink()
    config = root / "data" / "shield" / "config.json"
    saved = config.read_bytes()
    config.unlink()
    with pytest.raises(StateError, match=r"config\.json: recorded at save, missing"):
        mlflow.pyfunc.load_model(str(root))
    config.write_bytes(saved)
    mlmodel = root / "MLmodel"
    mlmodel.write_text(mlmodel.read_text().replace("digests:", "digests_gone:"))
    with pytest.raises(StateError, match="records no file digests"):
        mlflow.pyfunc.load_model(str(root))


def _saved_rps(tmp_path: Path) -> Path:
    rps = ReliableConformalClassifier(
        LogisticRegression(max_iter=300), n_train_parts=5, n_calib_parts=3
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rps.fit(X[:200], Y[:200]).conformalize(X[200:280], Y[200:280])
    rps_mlflow.save_model(rps, tmp_path / "r")
    return tmp_path / "r"


def test_an_rps_threshold_array_of_another_shape_is_refused(tmp_path):
    root = _saved_rps(tmp_path)
    with np.load(root / "data" / "shield" / "state.npz") as arrays:
        name = next(k for k in arrays.files if k.startswith("thresholds_"))
    _edit_state(root, lambda state: state.update({name: state[name][:-1]}))
    with pytest.raises(StateError, match=r"state\.npz: its sha256"):
        mlflow.pyfunc.load_model(str(root))
    reseal(root)  # an adversary who rewrites the digests too meets the shape check
    with pytest.raises(StateError, match=rf"state array '{name}' has shape \(2,\)"):
        mlflow.pyfunc.load_model(str(root))


def test_an_untouched_model_loads_after_a_reseal(tmp_path):
    root = _saved_ssd(tmp_path)
    reseal(root)
    assert mlflow.pyfunc.load_model(str(root)).predict(X[:2]).shape == (2, 3)


def test_a_wrapped_model_of_another_width_is_refused(tmp_path):
    from defenses.serving import check_output_width, load_inner, read_shielded

    root = _saved_ssd(tmp_path)
    folder = root / "data" / "shield"
    state, config = read_shielded(folder)
    layout = Layout.from_json(config["layout"])
    scorer = load_inner(folder / "model", config["models"]["model"], layout)
    check_output_width(scorer, layout, state["prototypes"].shape[0], "model")
    with pytest.raises(StateError, match=r"answers shape \(1, 3\) for one row"):
        check_output_width(scorer, layout, 4, "data/shield/model")
    with pytest.raises(StateError, match="fails on one row of zeros"):
        check_output_width(lambda batch: 1 / 0, layout, 3, "data/shield/model")


@pytest.mark.slow
def test_mlflow_models_serve_answers_400_and_refuses_an_edited_model(tmp_path):
    from defenses.model_server import ModelServer

    ssd_mlflow.save_model(_shielded_forest(), tmp_path / "m")
    rows = X[:2].tolist()
    with ModelServer(str(tmp_path / "m"), workers=1) as server:
        assert server.post(json.dumps({"inputs": rows}))[0] == 200
        rows[1][2] = 1e308
        status, body = server.post(json.dumps({"inputs": rows}))
    assert status == 400
    assert "column '2' is 1e+308, outside the model's range" in body
    assert "Traceback" not in body
    _edit_state(tmp_path / "m", _swap_rows)
    server = ModelServer(str(tmp_path / "m"), workers=1, start_timeout_s=120)
    with pytest.raises(RuntimeError, match="exited early: ") as refused:
        server.start()
    first = str(refused.value).splitlines()[0]
    assert "StateError: data/shield/state.npz: its sha256 digest" in first


def test_a_served_shield_refuses_a_resealed_model_of_another_width(tmp_path):
    import pickle

    root = _saved_ssd(tmp_path)
    stored = next((root / "data" / "shield" / "model").glob("*.pkl"))
    X4, Y4 = make_classification(
        120, X.shape[1], n_informative=3, n_redundant=0, n_classes=4, random_state=0
    )
    stored.write_bytes(pickle.dumps(LogisticRegression(max_iter=300).fit(X4, Y4)))
    reseal(root)  # digests rewritten too: the load's own width check still refuses
    with pytest.raises(StateError, match=r"answers shape \(1, 4\) for one row"):
        mlflow.pyfunc.load_model(str(root))
