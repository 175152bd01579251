from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.program.folding import Arm, initial_weights
from defense_suite.crypto.program.steps import (
    reference_step,
    simulated_loss,
    simulated_step,
)
from defense_suite.crypto.protocol.finetune import encrypted_step
from defense_suite.crypto.tasks import Sequences


def _batch(data: tuple[Sequences, Sequences]) -> tuple[np.ndarray, np.ndarray]:
    client = data[1]
    return client.X[100:104], client.y[100:104]


UNPADDED = partial(encrypted_step, answer_floor=0.0)
"""The encrypted step without the key owner's answer padding: these tests check
values, not timing (the padding is tested in ``test_client_rules``); with it, the
d = 8 step waits out every padded answer and ran past pytest's 600 s under load."""
STEPS: dict[str, tuple[Callable[..., Any], float]] = {
    "simulated": (simulated_step, 1e-9),
    "encrypted": (UNPADDED, 1e-4),
}
"""Each path of the packed step and its largest accepted |step - autograd| entry."""


@pytest.mark.parametrize("trained", ["lora", "full"])
@pytest.mark.parametrize(
    "path", ["simulated", pytest.param("encrypted", marks=pytest.mark.slow)]
)
def test_packed_steps_are_the_autograd_steps(
    tiny_model: HEFormer,
    tiny_data: tuple[Sequences, Sequences],
    trained: str,
    path: str,
) -> None:
    """float64 (fast) and TenSEAL as messages (slow, d = 8) against torch autograd."""
    step, tolerance = STEPS[path]
    X, y = _batch(tiny_data)
    arm = Arm(trained)
    before = initial_weights(tiny_model, arm)
    want = reference_step(tiny_model, X, y, 0.5, arm, steps=2)
    got = step(tiny_model, X, y, 0.5, arm, steps=2)
    assert set(got.weights) == set(arm.names)
    for name in arm.names:
        assert np.max(np.abs(want[name] - before[name])) > 1e-4, name
        assert np.max(np.abs(got.weights[name] - want[name])) < tolerance, name
    if path == "simulated":  # the message path's counts: test_tuning
        assert got.counts["roll_rounds"] == got.counts["unroll_rounds"] == 2
        assert got.counts["refresh_rounds"] > 0
        assert got.counts["slot_sums"] == 2 * sum(w.size for w in before.values())


def test_softmax_arm_gradient_matches_finite_differences(
    tiny_model: HEFormer, tiny_data: tuple[Sequences, Sequences]
) -> None:
    X, y = _batch(tiny_data)
    arm, lr, eps = Arm("full", "softmax"), 1e-3, 1e-5
    before = initial_weights(tiny_model, arm)
    after = simulated_step(tiny_model, X, y, lr, arm).weights
    model = copy.deepcopy(tiny_model)  # +eps -2eps +eps is not bit-exact: a copy
    for name, attr, (i, j) in (("wv", "v.weight", (1, 2)), ("w2", "w2", (2, 1))):
        grad = (before[name] - after[name])[i, j] / lr
        p = model.get_parameter(attr)
        with torch.no_grad():
            p[i, j] += eps
        up = simulated_loss(model, X, y, arm)
        with torch.no_grad():
            p[i, j] -= 2 * eps
        down = simulated_loss(model, X, y, arm)
        with torch.no_grad():
            p[i, j] += eps
        assert grad == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9)


CHANGES: dict[str, Callable[[HEFormer], Any]] = {
    "a parameter's last bit": lambda m: m.pool.data.view(torch.int64)[0, 0].add_(1),
    "a gradient": lambda m: setattr(m.pool, "grad", torch.zeros_like(m.pool)),
    "requires_grad": lambda m: m.pool.requires_grad_(False),
    "train / eval": lambda m: m.train(not m.training),
    "a calibrated range": lambda m: setattr(m.calibration, "pool_bound", 4.5),
    "a block's range": lambda m: setattr(m.calibration.layers[0], "ln_lo", 0.5),
    "a fit's coefficient": lambda m: m.calibration.polys[
        "tanh"
    ].coefficients.__setitem__(0, 1.0 + m.calibration.polys["tanh"].coefficients[0]),
}
"""In-place changes a test could make to a shared model, each one a different kind."""


def test_shared_fixture_guard_sees_every_in_place_change(micro_model: HEFormer) -> None:
    """The conftest's guard (after the finite-difference test once moved tiny_model)."""
    from tests.crypto.conftest import _BUILT, _restore, fingerprint

    start, saved = _BUILT["micro_model"]
    model = copy.deepcopy(micro_model)
    assert fingerprint(model) == fingerprint(micro_model) == start  # values, not ids
    for kind, change in CHANGES.items():
        change(model)
        assert fingerprint(model) != start, kind
        _restore(model, saved)
        assert fingerprint(model) == start, kind


def test_bad_inputs(
    tiny_model: HEFormer, tiny_data: tuple[Sequences, Sequences]
) -> None:
    X, y = _batch(tiny_data)
    with pytest.raises(ValueError, match="power of two"):
        simulated_step(tiny_model, X[:3], y[:3], 0.1)
    with pytest.raises(ValueError, match="lr"):
        simulated_step(tiny_model, X, y, 0.0)
    with pytest.raises(ValueError, match="labels"):
        simulated_step(tiny_model, X, y + 10, 0.1)
    with pytest.raises(ValueError, match=r"Arm\.trained"):
        Arm("adapter")
    with pytest.raises(ValueError, match="torch reference"):
        reference_step(tiny_model, X, y, 0.1, Arm("full", "softmax"))


def test_encrypted_steps_match_the_reference(micro_model: HEFormer) -> None:
    rng = np.random.default_rng(1)
    X = rng.random((4, 2, 3))
    y = np.array([0, 1, 1, 0])
    arm = Arm("lora")
    before = initial_weights(micro_model, arm)
    want = reference_step(micro_model, X, y, 0.5, arm)
    got = UNPADDED(micro_model, X, y, 0.5, arm)
    moved = max(np.max(np.abs(want[k] - before[k])) for k in arm.names)
    diff = max(np.max(np.abs(got.weights[k] - want[k])) for k in arm.names)
    assert moved > 1e-2
    assert diff < 1e-4
    assert got.counts["refresh_rounds"] > 0


def test_finetune_benchmark_bad_params() -> None:
    from defense_suite.crypto.benchmark.finetune import finetune_benchmark

    with pytest.raises(ValueError, match="arms"):
        list(finetune_benchmark({"arms": ["lora-relu"]}, [0]))
    with pytest.raises(ValueError, match="batch"):
        list(finetune_benchmark({"batch": 0}, [0]))
