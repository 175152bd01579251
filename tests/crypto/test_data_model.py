from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from defense_suite.crypto.he.approx import RangeError
from defense_suite.crypto.he.evaluator import DepthError, Evaluator, NumpyBackend
from defense_suite.crypto.he.packing import pack, roll_tokens
from defense_suite.crypto.models.heformer import HEFormer, ModelConfig
from defense_suite.crypto.models.train import TrainConfig, predict_logits, pretrain
from defense_suite.crypto.program.heformer import simulate
from defense_suite.crypto.tasks import (
    VOCABULARY,
    Sequences,
    client_transform,
    digit_sequences,
    negation_sentiment,
)


def test_digit_sequences_shape() -> None:
    d = digit_sequences()
    assert d.X.shape == (1797, 8, 8)
    assert d.n_classes == 10
    flipped = client_transform(d)
    assert np.array_equal(flipped.X[:, :, 0], d.X[:, :, -1])


def test_negation_rule_and_seed() -> None:
    a = negation_sentiment(np.random.default_rng(3), 50)
    b = negation_sentiment(np.random.default_rng(3), 50)
    assert np.array_equal(a.X, b.X)
    not_id = VOCABULARY.index("not")
    for x, y in zip(a.X, a.y, strict=True):
        words = [VOCABULARY[i] for i in x.argmax(1)]
        score, flip = 0, False
        for w in words:
            sign = 1 if w in VOCABULARY[:6] else -1 if w in VOCABULARY[6:12] else 0
            if sign:
                score += -sign if flip else sign
            flip = w == "not"
        assert int(score > 0) == y
    assert a.X[:, :, not_id].sum() > 0


def test_bad_data() -> None:
    with pytest.raises(ValueError, match="shape"):
        Sequences(np.zeros((3, 8)), np.zeros(3, dtype=np.int64), 2)
    with pytest.raises(ValueError, match="n must be"):
        negation_sentiment(np.random.default_rng(0), 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d": 10, "heads": 3}, "multiple"),
        ({"attention": "relu"}, "attention"),
        ({"rank": 0}, "rank"),
        ({"n_classes": 1}, "n_classes"),
    ],
)
def test_bad_config(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig(epochs=0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TrainConfig(batch=True), r"TrainConfig\.batch must be an int >= 1"),
        (lambda: TrainConfig(lr=0.0), r"TrainConfig\.lr must be a finite number"),
        (lambda: TrainConfig(penalty=-1.0), r"TrainConfig\.penalty .*got -1\.0"),
        (lambda: TrainConfig(noise=float("inf")), r"TrainConfig\.noise .*got inf"),
        (lambda: Evaluator(NumpyBackend(), 0), r"Evaluator\.max_level .* >= 1"),
        (lambda: NumpyBackend(noise=-0.1), r"NumpyBackend\.noise .*got -0\.1"),
        (lambda: ModelConfig(d=10, heads=3), r"ModelConfig\.d=10 .* of heads=3"),
        (lambda: ModelConfig(attention="relu"), r"one of \('gk', 'softmax'\)"),
    ],
)
def test_refusals_name_the_field_and_what_is_allowed(
    build: Callable[[], object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_simulation_matches_torch(
    tiny_model: HEFormer, tiny_data: tuple[Sequences, Sequences]
) -> None:
    X = tiny_data[1].X[100:140]
    plain = predict_logits(tiny_model, X)
    sim, counts = simulate(tiny_model, X, max_level=5)
    assert np.max(np.abs(plain - sim)) < 1e-9
    assert counts["refresh_rounds"] >= 3
    assert counts["roll_rounds"] == 1
    rolled, _ = simulate(tiny_model, X, interactive=False)
    assert np.max(np.abs(plain - rolled)) < 1e-9
    noisy, _ = simulate(
        tiny_model, X, noise=1e-5, rng=np.random.default_rng(0), max_level=5
    )
    assert 0 < np.max(np.abs(plain - noisy)) < 0.05


def test_non_interactive_depth_error(
    tiny_model: HEFormer, tiny_data: tuple[Sequences, Sequences]
) -> None:
    with pytest.raises(DepthError, match="non-interactive"):
        simulate(tiny_model, tiny_data[1].X[:4], max_level=10, interactive=False)
    _, counts = simulate(
        tiny_model, tiny_data[1].X[:4], max_level=26, interactive=False
    )
    assert "refresh_rounds" not in counts


def test_guard_and_shape(tiny_model: HEFormer) -> None:
    with pytest.raises(RangeError, match="calibrated range"):
        predict_logits(tiny_model, np.full((2, 8, 8), 20.0))
    with pytest.raises(ValueError, match="shape"):
        predict_logits(tiny_model, np.zeros((2, 7, 8)))
    fresh = HEFormer(ModelConfig(d=8, heads=1), torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="calibrate"):
        fresh(torch.zeros(1, 8, 8, dtype=torch.float64), poly=True)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(2, 8), st.integers(0, 20))
def test_roll_tokens_is_a_cyclic_group(batch: int, n: int, shift: int) -> None:
    values = np.arange(batch * n, dtype=np.float64)
    assert np.array_equal(
        roll_tokens(roll_tokens(values, n, shift), n, n - shift % n), values
    )
    rolled = roll_tokens(values, n, shift)
    assert rolled[0] == values[shift % n]


def test_pack_overflow() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        pack(np.zeros((5, 8, 4)), 32)


def _two_layer() -> tuple[HEFormer, Sequences]:
    data = digit_sequences().subset(np.arange(240))
    g = torch.Generator().manual_seed(1)
    config = ModelConfig(d=8, heads=2, ffn=8, n_layers=2)
    model = pretrain(
        data,
        config,
        g,
        TrainConfig(epochs=3, batch=80),
        TrainConfig(epochs=1, lr=3e-3, batch=80, penalty=10.0),
    )
    return model, data


def test_two_layers_calibrate_per_block_and_guard_names_the_block() -> None:
    torch.set_num_threads(1)
    model, data = _two_layer()
    cal = model.calibration
    assert len(model.blocks) == 2
    assert len(cal.layers) == 2
    first, second = cal.layers
    assert first.dist_bound == cal.dist_bound
    assert first.ln_div == cal.ln_div
    assert second.ln_div != first.ln_div  # each block has its own measured range
    assert set(second.polys) == {"gk", "isqrt"}
    # the calibrated poly model stays inside every block's range on its own data
    logits = predict_logits(model, data.X)
    assert logits.shape == (len(data), 10)
    # training moves every block's LoRA factors
    assert len(model.lora_parameters()) == 12
    # the guard names the block whose range breaks: block 1's variance
    second.ln_div = first.ln_div * 1e-3
    with pytest.raises(RangeError, match="layer 1 LayerNorm variance s"):
        predict_logits(model, data.X)
    # the single-block names refuse on a deeper model instead of answering block 0
    with pytest.raises(ValueError, match="n_layers=2"):
        _ = model.gamma
    with pytest.raises(ValueError, match="n_layers"):
        ModelConfig(n_layers=0)


def test_depth_changes_the_function_and_one_layer_keeps_its_names() -> None:
    g = torch.Generator().manual_seed(0)
    one = HEFormer(ModelConfig(d=8, heads=1), g)
    assert one.q is one.blocks[0].q
    assert one.gamma is one.blocks[0].gamma
    g = torch.Generator().manual_seed(0)
    two = HEFormer(ModelConfig(d=8, heads=1, n_layers=2), g)
    x = torch.rand(3, 8, 8, dtype=torch.float64, generator=g)
    # block 0 draws the same weights; the second block changes the output
    assert torch.equal(two.blocks[0].q.weight, one.q.weight)  # type: ignore[index]
    assert not torch.allclose(one(x), two(x))
    trace: dict[str, torch.Tensor] = {}
    two(x, trace=trace)
    assert "layer 1 kernel distance u" in trace
    assert "kernel distance u" in trace
