"""The encrypted Q/K/V LoRA step of a converted BERT's last block (or blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.crypto.tiny_bert import texts
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture

transformers = pytest.importorskip("transformers")

from defense_suite.crypto.conversion import HEBert  # noqa: E402
from defense_suite.crypto.conversion.tokenizer import encode  # noqa: E402
from defense_suite.crypto.he.ckks import INTERACTIVE_WIDE  # noqa: E402
from defense_suite.crypto.program.qkv_step import (  # noqa: E402
    apply_qkv_step,
    current_factors,
    encrypted_qkv_step,
    reference_qkv_step,
    simulated_qkv_step,
)

LABELS = np.array([1, 0, 1, 0])


def _batch(he: HEBert, tokenizer: object) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = encode(tokenizer, texts()[-4:], he)
    assert (mask == 0).any(), "the batch must exercise the padding mask"
    return ids, mask


def _gap(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert set(a) == set(b)
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def test_qkv_step_program_equals_autograd(converted: HEBert, tokenizer: object) -> None:
    ids, mask = _batch(converted, tokenizer)
    ref = reference_qkv_step(converted, ids, LABELS, 0.5, mask)
    assert ref.layers == (1,)
    assert len(ref.grads) == 6
    for k, g in ref.grads.items():  # every factor gets a real gradient
        assert np.max(np.abs(g)) > 1e-4, k
    sim = simulated_qkv_step(converted, ids, LABELS, 0.5, mask)
    assert _gap(sim.grads, ref.grads) < 1e-8
    assert _gap(sim.factors, ref.factors) < 1e-8
    assert sim.counts["roll_rounds"] == 2  # one per block
    assert sim.counts["unroll_rounds"] == 1  # the last block's keys and values
    assert "refresh_rounds" not in sim.counts
    # on the 7-level chain the program asks for refreshes; the result is unchanged
    chained = simulated_qkv_step(
        converted, ids, LABELS, 0.5, mask, max_level=INTERACTIVE_WIDE.levels
    )
    assert chained.counts["refresh_rounds"] > 0
    assert _gap(chained.grads, ref.grads) < 1e-8


def test_qkv_step_through_both_blocks_equals_autograd(
    converted: HEBert, tokenizer: object
) -> None:
    ids, mask = _batch(converted, tokenizer)
    ref = reference_qkv_step(converted, ids, LABELS, 0.5, mask, blocks=2)
    assert ref.layers == (0, 1)
    assert len(ref.grads) == 12
    for k, g in ref.grads.items():
        assert np.max(np.abs(g)) > 1e-4, k
    sim = simulated_qkv_step(
        converted, ids, LABELS, 0.5, mask, INTERACTIVE_WIDE.levels, blocks=2
    )
    assert _gap(sim.grads, ref.grads) < 1e-8
    assert sim.counts["unroll_rounds"] == 2
    last = simulated_qkv_step(converted, ids, LABELS, 0.5, mask)
    for k, g in last.grads.items():  # the last block's gradients are the same
        assert np.max(np.abs(g - sim.grads[k])) < 1e-12
    with pytest.raises(ValueError, match="trained blocks"):
        simulated_qkv_step(converted, ids, LABELS, 0.5, mask, blocks=3)


def test_qkv_step_updates_the_model_and_lowers_the_loss(
    converted: HEBert, tokenizer: object
) -> None:
    ids, mask = _batch(converted, tokenizer)
    before = current_factors(converted, 2)
    step = simulated_qkv_step(converted, ids, LABELS, 0.5, mask, blocks=2)
    target = np.eye(converted.config.n_classes)[LABELS]

    def loss() -> float:
        logits = converted.predict_logits(ids, mask)
        return float(0.5 * ((logits - target) ** 2).sum(1).mean())

    start = loss()
    try:
        apply_qkv_step(converted, step)
        assert _gap(current_factors(converted, 2), step.factors) == 0.0
        assert loss() < start
    finally:
        apply_qkv_step(converted, type(step)(step.layers, before, step.grads, 0.0, {}))
    assert _gap(current_factors(converted, 2), before) == 0.0


def test_qkv_step_refuses_bad_labels(converted: HEBert, tokenizer: object) -> None:
    ids, mask = _batch(converted, tokenizer)
    with pytest.raises(ValueError, match="labels for"):
        simulated_qkv_step(converted, ids, LABELS[:3], 0.5, mask)
    with pytest.raises(ValueError, match="labels must lie"):
        simulated_qkv_step(converted, ids, LABELS + 5, 0.5, mask)
    with pytest.raises(ValueError, match="integer labels"):
        reference_qkv_step(converted, ids, LABELS * 0.5, 0.5, mask)


QKV_STEP_BOUND = 1e-3
"""Largest |encrypted - autograd| factor entry accepted on INTERACTIVE_WIDE."""


@pytest.mark.slow
def test_encrypted_qkv_step_equals_the_plaintext_step(
    converted: HEBert, tokenizer: object
) -> None:
    ids, mask = _batch(converted, tokenizer)
    ref = reference_qkv_step(converted, ids, LABELS, 0.5, mask, blocks=2)
    enc = encrypted_qkv_step(
        converted, ids, LABELS, 0.5, INTERACTIVE_WIDE, mask, blocks=2
    )
    assert enc.layers == (0, 1)
    assert _gap(enc.factors, ref.factors) < QKV_STEP_BOUND
    assert enc.counts["refresh_rounds"] > 0


def test_byo_qkv_row_is_wired_and_off_by_default(
    converted: HEBert, tokenizer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from defense_suite.crypto.benchmark import byo_he

    ids, mask = _batch(converted, tokenizer)
    off = {"encrypted": 0, "lora_step": 0}
    assert byo_he.encrypted_rows(converted, ids, mask, LABELS, off, 0, {}) == []

    def simulated(model: HEBert, ids, y, lr, params, mask):  # type: ignore[no-untyped-def]
        assert params is INTERACTIVE_WIDE
        return simulated_qkv_step(model, ids, y, lr, mask)

    # the float64 program stands in for CKKS here (the slow test above runs CKKS)
    monkeypatch.setattr(byo_he, "encrypted_qkv_step", simulated)
    settings = {**off, "qkv_lora_step": 3}
    [row] = byo_he.encrypted_rows(converted, ids, mask, LABELS, settings, 0, {})
    assert row.defense == "qkv_lora_step"
    params = row.params["benchmark"]
    assert params["sequences"] == 3
    assert params["trained_blocks"] == [1]
    assert row.utility["max_abs_update_error"] < 1e-8
    assert row.cost["encrypted_step_s"] > 0
