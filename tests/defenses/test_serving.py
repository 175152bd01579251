"""The serving plumbing: request checks, the load loop, the load benchmark's records."""

from __future__ import annotations

import http.server
import json
import threading
import time

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("mlflow")

from defenses.model_server import LoadResult, ModelServer, batch_body, load
from defenses.serving import Layout, Refusal, check_batch
from defenses.serving_benchmark import _results, _setting, figures

LAYOUT = Layout(("a", "b"), max_rows=3)


def test_check_batch_takes_every_form_mlflow_hands_a_model():
    expected = np.array([[1.0, 2.0], [3.0, 4.0]])
    forms = [
        expected,
        [[1, 2], [3, 4]],
        pd.DataFrame({"b": [2, 4], "a": [1, 3]}),
        {"a": np.array([1, 3]), "b": np.array([2.0, 4.0])},
    ]
    for form in forms:
        assert np.array_equal(check_batch(form, LAYOUT), expected)
    assert (
        check_batch(expected, Layout(("a", "b"), dtype="float32")).dtype == np.float32
    )


@pytest.mark.parametrize(
    ("batch", "reason"),
    [
        (np.empty((0, 2)), "empty"),
        (np.zeros((4, 2)), "limit is 3 rows"),
        (np.zeros((2, 3)), "rows of 2 numbers"),
        (np.zeros(2), "rows of 2 numbers"),
        (np.array([["1", "2"]]), "numbers"),
        (np.array([[1.0, np.inf]]), "column 'b' is inf"),
        (pd.DataFrame({"a": [1.0], "c": [2.0]}), "missing [b], unexpected [c]"),
        (pd.DataFrame({"a": [1.0], "b": ["x"]}), "column 'b' must hold numbers"),
        ([[1.0, 2.0], [3.0]], "equal length"),
        (np.array(3.0), "single value"),
        ("a,b", "table or a list of rows"),
    ],
)
def test_check_batch_refuses_in_one_line(batch, reason):
    with pytest.raises(Refusal) as refused:
        check_batch(batch, LAYOUT)
    body = json.loads(refused.value.serialize_as_json())
    assert reason in body["message"]
    assert "\n" not in body["message"]
    assert refused.value.get_http_status_code() == 400


def test_layout_of_a_model_reads_its_names_or_counts():
    class Fitted:
        n_features_in_ = 3

    assert Layout.of(Fitted(), None).feature_names == ("0", "1", "2")
    assert Layout.of(None, None, ["x", "y"]).feature_names == ("x", "y")
    with pytest.raises(ValueError, match="2 names, but n_features=3"):
        Layout.of(None, 3, ["x", "y"])


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    delay = 0.0

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.delay)
        payload = b'{"predictions": [1]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def local_server():
    servers = []

    def start(delay: float):
        handler = type("Handler", (_Handler,), {"delay": delay})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_load_sends_exactly_the_requests_asked_for(local_server):
    port = local_server(0.0)
    result = load(port, b'{"inputs": [[1]]}', requests=25, concurrency=3)
    assert (result.ok, result.errors) == (25, 0)
    assert result.percentile_ms(50) <= result.percentile_ms(99)
    assert result.rps > 0


def test_load_stops_at_its_time_cap_and_counts_the_rest_as_errors(local_server):
    port = local_server(0.2)
    start = time.perf_counter()
    result = load(port, b"{}", requests=50, concurrency=2, time_cap_s=0.5)
    assert time.perf_counter() - start < 5
    assert result.ok + result.errors == 50
    assert result.errors >= 40


def test_batch_body_writes_floats_exactly():
    rows = np.random.default_rng(0).normal(size=(3, 4))
    assert np.array_equal(np.array(json.loads(batch_body(rows))["inputs"]), rows)


def test_the_server_runner_refuses_bad_settings():
    with pytest.raises(ValueError, match="workers"):
        ModelServer("m", workers=0)
    with pytest.raises(RuntimeError, match="not launched"):
        ModelServer("m").wait()


def test_benchmark_settings_are_checked():
    assert _setting({})["batches"] == [1, 256]
    with pytest.raises(ValueError, match="target_batch=256 must be one of"):
        _setting({"batches": [1, 16]})
    with pytest.raises(ValueError, match="non-empty list"):
        _setting({"concurrency": 4})
    with pytest.raises(ValueError, match=r"unknown|accepted"):
        _setting({"batch": [1]})


def _measured(ssd_ms: float, errors: int = 0):
    def run(ms, errs=0):
        return LoadResult(np.full(10, ms / 1e3), errs, 1.0)

    return {
        ("none", 1, 1): run(10.0),
        ("ssd", 1, 1): run(11.0),
        ("none", 256, 1): run(50.0),
        ("ssd", 256, 1): run(ssd_ms, errors),
    }


CPU = {("none", 1): 0.2, ("ssd", 1): 0.3, ("none", 256): 9.0, ("ssd", 256): 9.9}


def test_records_state_the_overhead_and_the_target(tmp_path):
    setting = _setting({"concurrency": [1]})
    met = {(r.defense, r.params["benchmark"]["batch"]): r for r in _results(
        0, setting, _measured(54.0), True, CPU
    )}  # fmt: skip
    assert met[("ssd", 256)].cost["p50_overhead"] == pytest.approx(0.08)
    assert met[("ssd", 256)].utility["target_met"] == 1.0
    assert met[("ssd", 256)].cost["handler_cpu_overhead"] == pytest.approx(0.1)
    assert met[("none", 1)].cost["handler_cpu_ms"] == 0.2
    assert "target_met" not in met[("ssd", 1)].utility
    assert met[("none", 256)].cost["target_p50_ms"] == pytest.approx(50.0)
    missed = [r for r in _results(0, setting, _measured(56.0), True, CPU) if r.utility]
    assert {r.utility.get("target_met") for r in missed} == {0.0, None}
    errors = list(_results(0, setting, _measured(50.0, 1), True, CPU))
    assert any(r.utility.get("target_met") == 0.0 for r in errors)
    drawn = figures(errors, tmp_path)
    assert len(drawn) == 1
    assert drawn[0][1].stat().st_size > 0
