"""The client's rules of issue 38, piece by piece (no encrypted session).

* :mod:`crypto.program.bounds`: any returned update (NaN, infinities, huge values) moves
  each matrix by at most the public bounds and leaves it finite; an honest step
  is returned bit for bit; the apply functions bound again; the bounds stated
  on the wire read back exactly, and any other statement reads as none.
* :mod:`crypto.program.shadow`: the advisory verdict equals the raising guard's, row by
  row, and never raises, even on non-finite weights.
* :mod:`crypto.protocol.timing`: the floor is checked, measured from public values with
  the counters left alone, and pads.
"""

from __future__ import annotations

import copy
import math
import time
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from defense_suite.crypto.he.approx import RangeError
from defense_suite.crypto.he.ckks import INTERACTIVE
from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.models.train import predict_logits
from defense_suite.crypto.program.bounds import (
    BOUNDS_KEY,
    UpdateBounds,
    apply_weights,
    bound_step,
    bound_update,
    sanitise,
    stated,
)
from defense_suite.crypto.program.folding import Arm, effective_weights
from defense_suite.crypto.program.shadow import flag_sequences
from defense_suite.crypto.protocol.client import Client
from defense_suite.crypto.protocol.schedule import Step
from defense_suite.crypto.protocol.timing import (
    check_floor,
    floor_parameter,
    pad,
    units,
)
from defense_suite.crypto.protocol.wire import Message

if TYPE_CHECKING:
    from defense_suite.crypto.conversion import HEBert

ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=64)
MATRIX = hnp.arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 4)))


@given(
    returned=MATRIX.flatmap(
        lambda m: hnp.arrays(np.float64, m.shape, elements=ANY_FLOAT)
    ),
    old_scale=st.floats(0.0, 10.0),
    entry=st.floats(1e-3, 10.0),
    norm=st.floats(1e-3, 10.0),
)
def test_bound_update_holds_for_any_returned_values(
    returned: np.ndarray, old_scale: float, entry: float, norm: float
) -> None:
    old = old_scale * np.linspace(-1.0, 1.0, returned.size).reshape(returned.shape)
    bounds = UpdateBounds(entry, norm)
    new, changed = bound_update({"W": old}, {"W": returned}, bounds)
    step = new["W"] - old
    assert np.all(np.isfinite(new["W"]))
    assert np.max(np.abs(step)) <= entry * (1 + 1e-9) + 1e-12
    assert math.sqrt(float(np.sum(step**2))) <= norm * (1 + 1e-9) + 1e-12
    assert 0 <= changed <= returned.size
    if not np.all(np.isfinite(returned)):
        assert changed > 0


def test_bound_update_keeps_an_honest_step_bit_for_bit() -> None:
    old = np.array([[0.5, -0.25], [0.125, 2.0]])
    returned = old - 0.01 * np.array([[1.0, -2.0], [3.0, 0.5]])
    new, changed = bound_update({"W": old}, {"W": returned}, UpdateBounds())
    assert changed == 0
    assert np.array_equal(new["W"], returned)


def test_bound_step_rules() -> None:
    bounds = UpdateBounds(entry=1.0, norm=1.5)
    d = bound_step(np.array([np.nan, np.inf, -np.inf, 0.5]), bounds)
    assert d.tolist() == [0.0, 0.0, 0.0, 0.5]  # non-finite to 0
    # per entry first (to +-1), then into the norm ball (radius 1: scaled 1/sqrt 2)
    d = bound_step(np.array([3.0, -3.0, 0.0]), UpdateBounds(entry=1.0, norm=1.0))
    assert np.allclose(d, [1 / math.sqrt(2), -1 / math.sqrt(2), 0.0])
    assert bound_step(np.array([3.0, -3.0]), bounds).tolist() == [1.0, -1.0]
    assert sanitise([1.0, np.nan]).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"UpdateBounds\.entry"):
        UpdateBounds(entry=0.0)
    with pytest.raises(ValueError, match=r"UpdateBounds\.norm"):
        UpdateBounds(norm=math.inf)
    with pytest.raises(ValueError, match="names"):
        bound_update({"A": np.zeros(2)}, {"B": np.zeros(2)}, bounds)
    with pytest.raises(ValueError, match="shape"):
        bound_update({"A": np.zeros(2)}, {"A": np.zeros(3)}, bounds)


POSITIVE = st.floats(min_value=5e-324, max_value=1.7e308)


@given(entry=POSITIVE | st.integers(1, 10**6), norm=POSITIVE)
def test_stated_bounds_read_back_exactly(entry: float, norm: float) -> None:
    """Any valid bounds survive the wire's JSON header: the agreement is exact."""
    bounds = UpdateBounds(entry, norm)
    message = Message("train", meta={"sequences": 4, BOUNDS_KEY: bounds.statement()})
    back = stated(Message.decode(message.encode()).meta)
    assert back == bounds
    assert back is not None
    assert back.statement() == bounds.statement()
    other = UpdateBounds(math.nextafter(float(entry), math.inf), norm)
    assert stated({BOUNDS_KEY: other.statement()}) != bounds  # one ulp differs


JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@given(value=JSON_VALUE)
def test_any_other_statement_reads_as_none(value: object) -> None:
    """What a server can put under the key is either valid bounds or none."""
    got = stated({BOUNDS_KEY: value})
    if got is not None:
        assert isinstance(value, dict)
        assert set(value) == {"entry", "norm"}
        for x in value.values():
            assert not isinstance(x, bool)
            assert math.isfinite(float(x))
            assert x > 0


def test_malformed_statements_read_as_none() -> None:
    cases: list[object] = [
        None,
        [1.0, 4.0],
        {"entry": 1.0},
        {"entry": 1.0, "norm": 4.0, "steps": 1},
        {"entry": True, "norm": 4.0},
        {"entry": "1.0", "norm": "4.0"},
        {"entry": math.nan, "norm": 4.0},
        {"entry": 1.0, "norm": math.inf},
        {"entry": -1.0, "norm": 4.0},
        {"entry": 0, "norm": 4.0},
        {"entry": 10**400, "norm": 4.0},
    ]
    for value in cases:
        assert stated({BOUNDS_KEY: value}) is None, value
    assert stated({}) is None
    assert stated({BOUNDS_KEY: {"entry": 1, "norm": 4}}) == UpdateBounds()
    # NaN arrives through JSON too: the wire's parser accepts it
    raw = Message("weights", meta={BOUNDS_KEY: "x"}).encode().replace(b'"x"', b"NaN")
    assert stated(Message.decode(raw).meta) is None


def test_apply_weights_bounds_and_round_trips(micro_head: HEFormer) -> None:
    model = copy.deepcopy(micro_head)
    arm = Arm("lora")
    before = effective_weights(model, arm)
    assert apply_weights(model, before) == 0  # the model's own weights: no change
    after = effective_weights(model, arm)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    crafted = {k: np.full_like(w, np.nan) for k, w in before.items()}
    crafted["q_a"] = np.full_like(before["q_a"], 1e30)
    changed = apply_weights(model, crafted, UpdateBounds(entry=0.5, norm=0.75))
    assert changed == sum(w.size for w in before.values())
    moved = effective_weights(model, arm)
    assert all(np.all(np.isfinite(w)) for w in moved.values())
    step = moved["q_a"] - before["q_a"]
    assert np.max(np.abs(step)) <= 0.5 + 1e-12
    assert np.linalg.norm(step) <= 0.75 + 1e-12
    assert np.array_equal(moved["classifier"], before["classifier"])  # NaN: no move
    full = Arm("full")
    merged = effective_weights(model, full)
    apply_weights(model, {"wq": merged["wq"] + 0.01})
    assert np.allclose(effective_weights(model, full)["wq"], merged["wq"] + 0.01)


def test_advisory_guard_equals_the_raising_guard_row_by_row(
    micro_head: HEFormer, micro_inputs: np.ndarray
) -> None:
    X = np.concatenate([micro_inputs[:6], 3.0 * micro_inputs[:6] - 1.0])
    flags = flag_sequences(micro_head, X)
    for row, flag in zip(X, flags, strict=True):
        try:
            predict_logits(micro_head, row[None], guard=True)
            refused = False
        except RangeError:
            refused = True
        assert flag == refused
    assert flags.any()
    assert not flags.all()


def test_advisory_guard_never_raises_on_non_finite_weights(
    micro_head: HEFormer, micro_inputs: np.ndarray
) -> None:
    model = copy.deepcopy(micro_head)
    with torch.no_grad():
        model.q.lora_a.fill_(np.nan)
    with pytest.raises(RangeError):
        predict_logits(model, micro_inputs[:3], guard=True)  # the old, loud guard
    assert flag_sequences(model, micro_inputs[:3]).tolist() == [True] * 3


def test_answer_floor_is_checked_measured_and_pads(micro_model: HEFormer) -> None:
    assert check_floor("auto") == "auto"
    assert check_floor(0.25) == 0.25
    for bad in (-1.0, math.nan, "fast", True):
        with pytest.raises(ValueError, match="answer_floor"):
            check_floor(bad)
        with pytest.raises(ValueError, match="benchmark parameter answer_floor"):
            floor_parameter({"answer_floor": bad})
    assert floor_parameter({}) == "auto"  # a benchmark pads unless told not to
    assert floor_parameter({"answer_floor": 0}) == 0.0
    step = Step("roll", "r", (1, 1), (8, 8), (1.0, 1.0), copies=2)
    assert units(step, 4) == 3.0
    start = time.perf_counter()
    pad(start, 0.05, 2.0)
    assert time.perf_counter() - start >= 0.1
    client = Client(micro_model, INTERACTIVE)
    assert client.answer_floor == "auto"
    floor = client.floor()
    assert floor > 0
    assert client.floor() == floor  # measured once
    # the measurement answered the client's own worst case: no count moved
    assert (client.decryptions, client.clipped, client.refreshes) == (0, 0, 0)


def test_converted_bert_steps_are_bounded(converted: HEBert, tokenizer: object) -> None:
    """The Q/K/V and adapter steps bound any step; apply_qkv_step bounds again."""
    from defense_suite.crypto.conversion.tokenizer import encode
    from defense_suite.crypto.program.head_step import simulated_head_step
    from defense_suite.crypto.program.qkv_step import (
        QKVStep,
        apply_qkv_step,
        current_factors,
        simulated_qkv_step,
    )
    from tests.crypto.tiny_bert import texts

    ids, mask = encode(tokenizer, texts()[-4:], converted)
    y = np.array([1, 0, 1, 0])
    bounds = UpdateBounds(entry=0.01, norm=0.02)
    honest = simulated_qkv_step(converted, ids, y, 0.5, mask)
    assert honest.clipped == 0
    wild = simulated_qkv_step(converted, ids, y, 1e12, mask)
    old = current_factors(converted)
    assert wild.clipped > 0
    for k, v in wild.factors.items():
        assert np.max(np.abs(v - old[k])) <= 1.0 + 1e-12
    model = copy.deepcopy(converted)
    nan = {k: np.full_like(v, np.nan) for k, v in old.items()}
    huge = {k: np.full_like(v, 1e300) for k, v in old.items()}
    for factors in (nan, huge):
        apply_qkv_step(model, QKVStep(wild.layers, factors, {}, 0.0, {}, bounds))
    moved = current_factors(model)
    for k, v in moved.items():
        assert np.all(np.isfinite(v))
        assert np.max(np.abs(v - old[k])) <= 0.01 + 1e-12
    rng = np.random.default_rng(0)
    A, B = 0.3 * rng.normal(size=(8, 2)), 0.3 * rng.normal(size=(2, 2))
    head = simulated_head_step(converted, ids, y, A, B, 1e12, mask)
    assert head.clipped > 0
    assert np.max(np.abs(head.a - A)) <= 1.0 + 1e-12
    assert np.all(np.isfinite(head.b))


def test_calibrated_session_reports_a_batch_it_clips(
    micro_model: HEFormer, micro_inputs: np.ndarray
) -> None:
    """The calibrated client's batch check is advisory in a session too."""
    from dataclasses import replace

    from defense_suite.crypto.protocol.schedule import check_batch, exceeds
    from defense_suite.crypto.protocol.server import Server

    client = Client(micro_model, INTERACTIVE, micro_inputs, answer_floor=0.0)
    schedule = client.schedule(True)
    tight = replace(
        schedule,
        steps=tuple(replace(s, bounds=(1e-6,) * len(s.bounds)) for s in schedule.steps),
    )
    X = micro_inputs[:2]
    assert not exceeds(schedule, micro_model, X)
    assert exceeds(tight, micro_model, X)
    with pytest.raises(RangeError):
        check_batch(tight, micro_model, X)  # the caller's own, raising check
    client._schedules[True] = tight
    logits = client.predict(Server.for_model(None, micro_model, INTERACTIVE), X)
    assert logits.shape == (2, 2)
    assert client.flagged.tolist() == [True, True]
    assert client.clipped > 0
