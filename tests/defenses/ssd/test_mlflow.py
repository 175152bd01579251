"""SSD as an MLflow model: the flavour in process, then served by MLflow's server.

The served tests (``slow``: each server start imports MLflow, torch and scikit-learn
in every worker) start the real server with two workers on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import http.client
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import chisquare
from sklearn.datasets import make_classification
from sklearn.linear_model import LogisticRegression

mlflow = pytest.importorskip("mlflow")

from defenses.model_server import ModelServer  # noqa: E402
from defenses.serving import Layout, Refusal  # noqa: E402
from defenses.serving_seal import StateError  # noqa: E402
from defenses.ssd import mlflow as ssd_mlflow  # noqa: E402
from defenses.ssd.defense import StealthyShield, entropy  # noqa: E402
from defenses.ssd.sklearn import ShieldedClassifier  # noqa: E402
from defenses.ssd.torch import ShieldedModule  # noqa: E402
from defenses.ssd.waterfill import water_filling  # noqa: E402

NAMES = ["a", "b", "c", "d"]


def _data(n: int = 300):
    X, y = make_classification(
        n, 4, n_informative=3, n_redundant=0, n_classes=3, class_sep=0.6,
        random_state=0,
    )  # fmt: skip
    return X, y


def _classifier(seeding: str = "input-hash", frame: bool = False):
    X, y = _data()
    data = pd.DataFrame(X, columns=NAMES) if frame else X
    shield = StealthyShield(epsilon=1.0, seed=3, n_threads=1)
    est = LogisticRegression(max_iter=500)
    model = ShieldedClassifier(est, shield, seeding=seeding, random_state=0)
    return model.fit(data, y), X


def _module():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    X, y = _data()
    with torch.no_grad():
        val = torch.softmax(net(torch.tensor(X, dtype=torch.float32)), 1).double()
    shield = StealthyShield(epsilon=1.0, seed=5, seeding="input-hash", n_threads=1)
    shield.fit(val.numpy(), y)
    return ShieldedModule(net, shield), X


def _uncertain_row(model) -> np.ndarray:
    """The training row whose undefended output has the highest entropy."""
    X, _ = _data()
    probs = model.estimator_.predict_proba(X)
    return X[[int(np.argmax(entropy(probs)))]]


def _pseudo_labels(model, row: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """Which class prototype each answer was projected towards (exact match)."""
    shield = model.shield_
    f = model.estimator_.predict_proba(row)
    k = shield.n_classes
    budget = np.full(k, float(shield.epsilon) * entropy(f)[0])
    candidates = water_filling(np.repeat(f, k, 0), shield.prototypes_, budget)
    gaps = np.abs(answers[:, None, :] - candidates[None, :, :]).sum(-1)
    assert np.all(gaps.min(1) < 1e-9), "an answer matches no class's projection"
    return gaps.argmin(1)


def _folder_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + file.read_bytes())
    return digest.hexdigest()


# --- the flavour, in process --------------------------------------------------------


def test_sklearn_round_trip_gives_the_in_process_answers(tmp_path):
    model, X = _classifier()
    ssd_mlflow.save_model(model, tmp_path / "m")
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "m"))
    served = loaded.predict(X[:50])
    assert np.array_equal(served, model.predict_proba(X[:50]))
    frame = pd.DataFrame(X[:50], columns=[str(i) for i in range(4)])
    assert np.array_equal(loaded.predict(frame), served)
    assert np.allclose(served.sum(1), 1.0)
    meta = loaded.metadata
    assert meta.metadata["ssd_classes"] == [0, 1, 2]
    assert "defenses_ssd" in meta.flavors


def test_named_columns_any_order_and_log_model(tmp_path, monkeypatch):
    model, X = _classifier(frame=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)  # a database store puts artifacts in ./mlruns
    with mlflow.start_run():
        info = ssd_mlflow.log_model(model, name="shielded")
    loaded = mlflow.pyfunc.load_model(info.model_uri)
    frame = pd.DataFrame(X[:20], columns=NAMES)
    served = loaded.predict(frame[["d", "b", "a", "c"]])
    assert np.array_equal(loaded.predict(X[:20]), served)
    # the served hash is of the float64 row in layout order: the in-process
    # wrapper's answer on the same rows as an array (it hashes a frame by pandas)
    with pytest.warns(UserWarning, match="feature names"):
        assert np.array_equal(served, model.predict_proba(X[:20]))


def test_torch_module_round_trip(tmp_path):
    module, X = _module()
    ssd_mlflow.save_model(module, tmp_path / "t", n_features=4)
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "t"))
    served = loaded.predict(X[:40])
    expected = module(torch.tensor(X[:40], dtype=torch.float32)).numpy()
    assert np.array_equal(served.astype(np.float32), expected)


def test_any_pyfunc_model_by_uri(tmp_path):
    X, y = _data()
    est = LogisticRegression(max_iter=500).fit(X[:200], y[:200])
    import mlflow.sklearn

    mlflow.sklearn.save_model(
        est, str(tmp_path / "plain"), serialization_format="cloudpickle",
        pyfunc_predict_fn="predict_proba",
    )  # fmt: skip
    shield = StealthyShield(seed=1, seeding="input-hash", n_threads=1)
    shield.fit(est.predict_proba(X[200:]), y[200:])
    with pytest.raises(ValueError, match="number of features is unknown"):
        ssd_mlflow.save_model(str(tmp_path / "plain"), tmp_path / "x", shield=shield)
    ssd_mlflow.save_model(
        str(tmp_path / "plain"), tmp_path / "s", shield=shield, n_features=4
    )
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "s"))
    expected = shield(est.predict_proba(X[:30]), inputs=X[:30])
    assert np.array_equal(loaded.predict(X[:30]), expected)


def test_the_shield_is_stored_as_arrays_not_pickled_code(tmp_path):
    model, _ = _classifier()
    ssd_mlflow.save_model(model, tmp_path / "m")
    shield_dir = tmp_path / "m" / "data" / "shield"
    own = sorted(p.name for p in shield_dir.iterdir() if p.is_file())
    assert own == ["config.json", "state.npz"]
    with np.load(shield_dir / "state.npz", allow_pickle=False) as state:
        assert sorted(state.files) == ["prototypes", "settings", "stream"]
        assert np.array_equal(state["prototypes"], model.shield_.prototypes_)
    for file in (tmp_path / "m" / "data" / "shield" / "model").iterdir():
        if file.suffix == ".pkl":
            assert b"defenses" not in file.read_bytes()


def test_random_seeding_draws_a_fresh_key_per_loaded_copy(tmp_path):
    # noise replay: two workers (or a restart) must not replay one random stream
    model, _ = _classifier(seeding="random")
    ssd_mlflow.save_model(model, tmp_path / "r")
    row = np.repeat(_uncertain_row(model), 200, 0)
    first = mlflow.pyfunc.load_model(str(tmp_path / "r")).predict(row)
    second = mlflow.pyfunc.load_model(str(tmp_path / "r")).predict(row)
    assert not np.array_equal(first, second)
    labels = _pseudo_labels(model, row[:1], np.concatenate([first, second]))
    assert len(set(labels.tolist())) > 1


def test_concurrent_requests_never_share_random_draws(tmp_path):
    # MLflow's server runs predict in threads: two requests must not read the same
    # stream position (their answers to the same batch would be identical)
    from concurrent.futures import ThreadPoolExecutor

    model, _ = _classifier(seeding="random")
    ssd_mlflow.save_model(model, tmp_path / "r")
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "r"))
    batch = np.repeat(_uncertain_row(model), 300, 0)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: loaded.predict(batch), range(16)))
    labels = {tuple(_pseudo_labels(model, batch[:1], a).tolist()) for a in answers}
    assert len(labels) == 16
    assert loaded._model_impl.shield.counter_ == 16 * 300


def test_random_seeding_follows_the_pseudo_label_distribution(tmp_path):
    model, _ = _classifier(seeding="random")
    ssd_mlflow.save_model(model, tmp_path / "r")
    row = _uncertain_row(model)
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "r"))
    answers = np.concatenate([loaded.predict(np.repeat(row, 500, 0)) for _ in range(4)])
    counts = np.bincount(_pseudo_labels(model, row, answers), minlength=3)
    expected = model.shield_.sampling_probs(model.estimator_.predict_proba(row))[0]
    assert chisquare(counts, expected * counts.sum()).pvalue > 1e-4


BAD_BATCHES = {
    "empty": lambda X: np.empty((0, 4)),
    "too many rows": lambda X: np.zeros((1025, 4)),
    "wrong width": lambda X: X[:2, :3],
    "one row as a vector": lambda X: X[0],
    "strings": lambda X: np.array([["x", "1", "2", "3"]]),
    "NaN": lambda X: np.where(np.eye(4, dtype=bool)[:2], np.nan, X[:2]),
    "inf": lambda X: np.full((1, 4), np.inf),
    "wrong columns": lambda X: pd.DataFrame(X[:2], columns=["0", "1", "2", "x"]),
    "object column": lambda X: pd.DataFrame(
        {**{str(i): X[:2, i] for i in range(3)}, "3": ["a", "b"]}
    ),
    "ragged dict": lambda X: {"0": [1.0], "1": [1.0, 2.0], "2": [1.0], "3": [1.0]},
    "a string": lambda X: "1,2,3,4",
}


@pytest.fixture(scope="module")
def hashed_array(tmp_path_factory):
    model, X = _classifier()
    path = tmp_path_factory.mktemp("ssd") / "m"
    ssd_mlflow.save_model(model, path)
    return X, path


@pytest.mark.parametrize("name", sorted(BAD_BATCHES))
def test_bad_batches_are_refused_in_one_line_and_change_nothing(hashed_array, name):
    X, path = hashed_array
    loaded = mlflow.pyfunc.load_model(str(path))
    shield = loaded._model_impl.shield  # MLflow's stable developer API
    before = (shield.prototypes_.copy(), shield.key_, shield.counter_)
    answer = loaded.predict(X[:5])
    with pytest.raises(Refusal) as refused:
        loaded.predict(BAD_BATCHES[name](X))
    body = json.loads(refused.value.serialize_as_json())
    assert body["error_code"] == "BAD_REQUEST"
    assert refused.value.get_http_status_code() == 400
    assert body["message"]
    assert "\n" not in body["message"]
    assert np.array_equal(shield.prototypes_, before[0])
    assert (shield.key_, shield.counter_) == before[1:]
    assert np.array_equal(loaded.predict(X[:5]), answer)


def test_a_model_that_cannot_take_the_layout_is_refused_at_load(tmp_path):
    module, _ = _module()
    # the layout says 5 features, the module takes 4: the load's probe row fails
    ssd_mlflow.save_model(module, tmp_path / "t", n_features=5)
    with pytest.raises(StateError, match="data/shield/model: the wrapped model fails"):
        mlflow.pyfunc.load_model(str(tmp_path / "t"))


def test_an_error_in_the_model_is_a_one_line_500(tmp_path):
    module, _ = _module()
    ssd_mlflow.save_model(module, tmp_path / "t", n_features=4)
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "t"))

    def failing(batch: object) -> object:
        raise RuntimeError("secret detail that must stay in the server log")

    loaded._model_impl.scorer = failing  # the model fails at request time
    with pytest.raises(Refusal) as refused:
        loaded.predict(np.zeros((2, 4)))
    assert refused.value.get_http_status_code() == 500
    body = json.loads(refused.value.serialize_as_json())
    assert body["message"] == "the model failed (RuntimeError); see the server log"


def test_save_refuses_what_it_cannot_store(tmp_path):
    model, _ = _classifier()
    with pytest.raises(ValueError, match="not fitted"):
        ssd_mlflow.save_model(
            ShieldedClassifier(LogisticRegression(), StealthyShield()), tmp_path / "a"
        )
    with pytest.raises(TypeError, match="StealthyShield"):
        ssd_mlflow.save_model(LogisticRegression(), tmp_path / "b")
    with pytest.raises(ValueError, match="classes has 2 labels"):
        ssd_mlflow.save_model(model, tmp_path / "c", classes=["x", "y"])
    with pytest.raises(ValueError, match="number of features is unknown"):
        ssd_mlflow.save_model(_module()[0], tmp_path / "d")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "f").write_text("x")
    with pytest.raises(FileExistsError):
        ssd_mlflow.save_model(model, tmp_path / "e")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"feature_names": ()}, "feature_names"),
        ({"feature_names": ("a", "a")}, "distinct"),
        ({"feature_names": ("a",), "max_rows": 0}, "max_rows"),
        ({"feature_names": ("a",), "dtype": "int8"}, "dtype"),
    ],
)
def test_layout_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout(**kwargs)


# --- served by mlflow models serve ---------------------------------------------------


def _post(server: ModelServer, payload) -> tuple[int, dict]:
    status, text = server.post(
        payload if isinstance(payload, str) else json.dumps(payload)
    )
    return status, json.loads(text)


def _answers_per_worker(server: ModelServer, body: str, tries: int = 60) -> dict:
    """Answers to ``body`` keyed by the worker process that accepted the connection."""
    psutil = pytest.importorskip("psutil")
    root = psutil.Process(server.process.pid)
    seen: dict[int, list[str]] = {}
    for _ in range(tries):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        connection.request(
            "POST", "/invocations", body, {"Content-Type": "application/json"}
        )
        text = connection.getresponse().read().decode()
        port = connection.sock.getsockname()[1]
        owners = [
            p.pid
            for p in root.children(recursive=True)
            if any(c.raddr and c.raddr.port == port for c in p.net_connections("tcp"))
        ]
        connection.close()
        assert len(owners) == 1
        seen.setdefault(owners[0], []).append(text)
        if len(seen) >= 2 and sum(map(len, seen.values())) >= 8:
            break
    return seen


@pytest.fixture(scope="module")
def hashed_model(tmp_path_factory):
    model, X = _classifier(frame=True)
    path = tmp_path_factory.mktemp("served") / "ssd"
    ssd_mlflow.save_model(model, path)
    return model, X, path


@pytest.mark.slow
def test_served_sklearn_model_is_consistent_across_formats_workers_restarts(
    hashed_model,
):
    model, X, path = hashed_model
    rows = X[:3]
    with pytest.warns(UserWarning, match="feature names"):  # hashed as an array
        expected = model.predict_proba(rows).tolist()
    requests = [
        {"inputs": rows.tolist()},
        {"instances": rows.tolist()},
        {"dataframe_split": {"columns": NAMES, "data": rows.tolist()}},
        {
            "dataframe_records": [
                dict(zip(NAMES[::-1], r[::-1], strict=True)) for r in rows.tolist()
            ]
        },
    ]
    digest = _folder_digest(path)
    with ModelServer(str(path), workers=2) as server:
        for payload in requests:
            status, body = _post(server, payload)
            assert status == 200, body
            assert body["predictions"] == expected
        per_worker = _answers_per_worker(server, json.dumps(requests[0]))
        assert len(per_worker) == 2, "one worker answered every connection"
        answers = {text for texts in per_worker.values() for text in texts}
        assert len(answers) == 1
        bad = [
            "{not json",
            json.dumps({"inputs": []}),
            json.dumps({"inputs": [[1.0, 2.0, 3.0]]}),
            json.dumps({"inputs": [["a", 1, 2, 3]]}),
            '{"inputs": [[NaN, 1, 2, 3]]}',
            json.dumps({"inputs": np.zeros((1025, 4)).tolist()}),
            json.dumps(
                {
                    "dataframe_split": {
                        "columns": ["a", "b", "c", "x"],
                        "data": rows.tolist(),
                    }
                }
            ),
            json.dumps({"rows": rows.tolist()}),
        ]
        for payload in bad:
            status, body = _post(server, payload)
            assert 400 <= status < 500, (payload[:40], body)
            assert "stack_trace" not in body
            assert "Traceback" not in body["message"]
            if payload not in ("{not json", json.dumps({"rows": rows.tolist()})):
                assert "\n" not in body["message"], body  # ours: one line
            status, answer = _post(server, requests[0])
            assert (status, answer["predictions"]) == (200, expected)
    assert _folder_digest(path) == digest
    with ModelServer(str(path), workers=2) as server:
        assert _post(server, requests[2])[1]["predictions"] == expected


@pytest.mark.slow
def test_logged_torch_model_served_by_uri_is_consistent_across_workers(
    tmp_path, monkeypatch
):
    module, X = _module()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)  # a database store puts artifacts in ./mlruns
    with mlflow.start_run():
        info = ssd_mlflow.log_model(module, name="torch-ssd", n_features=4)
    expected = module(torch.tensor(X[:4], dtype=torch.float32)).numpy()
    # the server inherits the tracking URI and resolves the logged model's URI
    with ModelServer(info.model_uri, workers=2) as server:
        per_worker = _answers_per_worker(server, json.dumps({"inputs": X[:4].tolist()}))
    assert len(per_worker) == 2
    answers = {text for texts in per_worker.values() for text in texts}
    assert len(answers) == 1
    served = np.array(json.loads(answers.pop())["predictions"])
    assert np.array_equal(served.astype(np.float32), expected)


@pytest.mark.slow
def test_served_random_seeding_follows_the_distribution_per_worker(tmp_path):
    model, _ = _classifier(seeding="random")
    ssd_mlflow.save_model(model, tmp_path / "r")
    row = _uncertain_row(model)
    body = json.dumps({"inputs": np.repeat(row, 256, 0).tolist()})
    with ModelServer(str(tmp_path / "r"), workers=2) as server:
        per_worker = _answers_per_worker(server, body, tries=60)
    assert len(per_worker) == 2
    expected = model.shield_.sampling_probs(model.estimator_.predict_proba(row))[0]
    firsts = []
    for texts in per_worker.values():
        answers = np.concatenate([json.loads(t)["predictions"] for t in texts])
        labels = _pseudo_labels(model, row, answers)
        counts = np.bincount(labels, minlength=3)
        assert chisquare(counts, expected * counts.sum()).pvalue > 1e-4
        firsts.append(texts[0])
    # each worker's first answer starts its own stream: equal keys would repeat it
    assert firsts[0] != firsts[1]
