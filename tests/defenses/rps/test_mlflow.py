"""RPS prediction sets as an MLflow model, in process and served by MLflow's server."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn.datasets import make_classification
from sklearn.linear_model import LogisticRegression

mlflow = pytest.importorskip("mlflow")

from defenses.model_server import ModelServer  # noqa: E402
from defenses.rps import ReliableConformalClassifier  # noqa: E402
from defenses.rps import mlflow as rps_mlflow  # noqa: E402
from defenses.serving import Refusal  # noqa: E402

NAMES = ["f0", "f1", "f2", "f3", "f4"]


def _fitted(confidence_level=0.9, frame: bool = False):
    X, y = make_classification(
        600, 5, n_informative=4, n_redundant=0, n_classes=3, random_state=1
    )
    data = pd.DataFrame(X, columns=NAMES) if frame else X
    rps = ReliableConformalClassifier(
        LogisticRegression(max_iter=300), n_train_parts=5, n_calib_parts=3,
        confidence_level=confidence_level,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rps.fit(data[:400] if frame else X[:400], y[:400])
        rps.conformalize(data[400:550] if frame else X[400:550], y[400:550])
    return rps, X[550:]


def _sets_of(frame: pd.DataFrame) -> np.ndarray:
    return frame[[c for c in frame.columns if c.startswith("in_set")]].to_numpy()


def test_loaded_sets_are_the_classifiers_sets(tmp_path):
    rps, X = _fitted()
    rps_mlflow.save_model(rps, tmp_path / "m")
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "m"))
    answer = loaded.predict(X)
    prediction, sets = rps.predict_set(X)
    assert list(answer.columns) == [
        "prediction", "set_size", "in_set[0]", "in_set[1]", "in_set[2]",
    ]  # fmt: skip
    assert np.array_equal(_sets_of(answer).astype(bool), sets[:, :, 0])
    assert np.array_equal(answer["prediction"].to_numpy(), prediction)
    assert np.array_equal(answer["set_size"].to_numpy(), sets[:, :, 0].sum(1))
    assert loaded.metadata.metadata["rps_columns"] == list(answer.columns)
    state = tmp_path / "m" / "data" / "shield"
    own = sorted(p.name for p in state.iterdir() if p.is_file())
    assert own == ["config.json", "state.npz"]
    np.load(state / "state.npz", allow_pickle=False).close()


def test_several_levels_string_labels_and_named_columns(tmp_path, monkeypatch):
    rps, X = _fitted(confidence_level=[0.8, 0.9], frame=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)  # a database store puts artifacts in ./mlruns
    with mlflow.start_run():
        info = rps_mlflow.log_model(rps, name="sets")
    loaded = mlflow.pyfunc.load_model(info.model_uri)
    frame = pd.DataFrame(X, columns=NAMES)
    answer = loaded.predict(frame[NAMES[::-1]])
    _, sets = rps.predict_set(frame)
    assert "in_set[2]@0.9" in answer.columns
    expected = sets.transpose(0, 2, 1).reshape(len(X), -1)
    assert np.array_equal(_sets_of(answer).astype(bool), expected)


@pytest.mark.parametrize(
    "bad",
    [np.empty((0, 5)), np.zeros((1025, 5)), np.zeros((2, 4)), np.full((1, 5), np.nan)],
    ids=["empty", "over the limit", "wrong width", "NaN"],
)
def test_bad_batches_are_refused_and_the_thresholds_stay(tmp_path, bad):
    rps, X = _fitted()
    rps_mlflow.save_model(rps, tmp_path / "m")
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "m"))
    served = loaded._model_impl.rps  # MLflow's stable developer API
    before = served.part_thresholds_.lower.copy()
    answer = loaded.predict(X)
    with pytest.raises(Refusal) as refused:
        loaded.predict(bad)
    assert refused.value.get_http_status_code() == 400
    assert "\n" not in json.loads(refused.value.serialize_as_json())["message"]
    assert np.array_equal(served.part_thresholds_.lower, before)
    pd.testing.assert_frame_equal(loaded.predict(X), answer)


def test_save_refuses_what_it_cannot_store(tmp_path):
    rps, _ = _fitted()
    with pytest.raises(ValueError, match="fitted and conformalized"):
        rps_mlflow.save_model(ReliableConformalClassifier(), tmp_path / "a")
    with pytest.raises(TypeError, match="ReliableConformalClassifier"):
        rps_mlflow.save_model(LogisticRegression(), tmp_path / "b")
    rps.odd_ = object()
    with pytest.raises(TypeError, match="odd_"):
        rps_mlflow.save_model(rps, tmp_path / "c")


def test_a_state_naming_a_foreign_class_is_refused(tmp_path):
    # the loader rebuilds dataclasses of defenses.rps only: a tampered state that
    # names another module is refused, not imported
    # (edited behind the digests' back: the loader's own check, not the digest's)
    from defenses.serving import read_shielded

    rps, _ = _fitted()
    rps_mlflow.save_model(rps, tmp_path / "m")
    state, data = read_shielded(tmp_path / "m" / "data" / "shield")
    data["fitted"]["part_thresholds_"]["dataclass"] = "os:system"
    with pytest.raises(ValueError, match=r"not a module of defenses\.rps"):
        rps_mlflow.restore(state, data, list(rps.estimators_))
    config = tmp_path / "m" / "data" / "shield" / "config.json"
    config.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"config\.json"):  # and the digest's
        mlflow.pyfunc.load_model(str(tmp_path / "m"))


@pytest.mark.slow
def test_served_sets_are_identical_across_workers_and_refuse_bad_requests(tmp_path):
    rps, X = _fitted()
    rps_mlflow.save_model(rps, tmp_path / "m")
    _, sets = rps.predict_set(X[:8])
    body = json.dumps({"inputs": X[:8].tolist()})
    with ModelServer(str(tmp_path / "m"), workers=2) as server:
        answers = {server.post(body) for _ in range(12)}
        assert len(answers) == 1
        good = answers.pop()
        assert good[0] == 200
        records = pd.DataFrame(json.loads(good[1])["predictions"])
        assert np.array_equal(_sets_of(records).astype(bool), sets[:, :, 0])
        for bad in ('{"inputs": []}', '{"inputs": [[1, 2]]}', "{oops"):
            status, text = server.post(bad)
            assert 400 <= status < 500
            assert "stack_trace" not in json.loads(text)
        assert server.post(body) == good
