"""One backward pass for both families, against the stored goldens of the passes it
replaced.

The goldens (:mod:`tests.crypto.golden`) hold what the pre-issue-41 backward passes
(the HEFormer's ``backprop``/``attention_grad``/``net`` primitives, the converted
BERT's ``bert_lora`` and ``bert_tuning.head_gradients``, at commit 9770ea3) computed
on these cases: each test runs :mod:`crypto.program.backward` on NumpyBackend
(float64, no noise) with a recording key owner and asks for the same gradient sums
bit for bit, the same operation counts and the same refresh/roll/unroll log
(stage, size, in order).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from defense_suite.crypto.he.evaluator import Value
from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.program.backward import (
    Trained,
    adapter_gradients,
    backward,
    loss_gradient,
    train_forward,
)
from defense_suite.crypto.program.folding import Arm
from defense_suite.crypto.program.forward import Run
from tests.crypto.golden import cases as C
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def tokenizer() -> object:
    """The goldens' BERT cases read their vocabulary (a trained one varies)."""
    pytest.importorskip("transformers")
    return C.fixed_tokenizer()


@pytest.fixture(scope="module")
def golden() -> dict[str, dict[str, C.Record]]:
    names = ("heformer_backward", "bert_backward", "bert_adapter")
    return {name: C.load(name) for name in names}


def _heformer(
    model: HEFormer, X: np.ndarray, y: np.ndarray, arm: Arm, level: int
) -> C.Record:
    net, z, targets, m = C.heformer_step(model, X, y, arm)
    owner = C.Owner(net.n_tokens)
    ev = owner.evaluator(level)
    p, t = net.program(), Trained(1, net.softmax)
    run = Run(ev, net.secrets(), owner.roll)
    logits = train_forward(run, p, z, t)
    grads = backward(run, p, loss_gradient(ev, logits, targets, m), owner.unroll, t)
    return C.backward_record(grads, ev, owner)


def _nonzero(record: C.Record) -> list[bool]:
    return [bool(np.abs(a).max() > 1e-6) for a in record[0].values()]


@pytest.mark.parametrize(
    ("arm", "level"), C.HEFORMER_BACKWARD, ids=lambda x: str(getattr(x, "trained", x))
)
def test_heformer_gradients_equal_the_golden(
    golden: Any, micro_model: HEFormer, micro_inputs: np.ndarray, arm: Arm, level: int
) -> None:
    X, y = micro_inputs[:4], np.array([0, 1, 1, 0])
    got = _heformer(micro_model, X, y, arm, level)
    case = f"micro {C.arm_name(arm)} {level}"
    C.assert_same(got, golden["heformer_backward"][case], case)
    if level == 3:
        assert got[1]["counts"]["refresh_rounds"] > 10  # the short chain fits
    assert any(_nonzero(got))


def test_heformer_two_heads_tiny_model(
    golden: Any, tiny_model: HEFormer, tiny_data: Any
) -> None:
    client = tiny_data[1]
    for arm, level in C.TINY_BACKWARD:
        got = _heformer(tiny_model, client.X[:2], client.y[:2], arm, level)
        case = f"tiny {C.arm_name(arm)} {level}"
        C.assert_same(got, golden["heformer_backward"][case], case)


def _bert_values(
    inputs: list[np.ndarray], targets: list[np.ndarray], factors: Any
) -> Any:
    slots = len(inputs[0])
    values = [Value(np.array(v)) for v in inputs]
    lora = {k: C.encrypted(M, slots) for k, M in factors.items()}
    return values, lora, [Value(np.array(t)) for t in targets]


@pytest.mark.parametrize(("blocks", "level"), C.BERT_BACKWARD)
def test_bert_qkv_gradients_equal_the_golden(
    golden: Any, converted: Any, tokenizer: object, blocks: int, level: int
) -> None:
    pytest.importorskip("transformers")
    from defense_suite.crypto.program.spec import from_bert

    w, inputs, targets, m, factors = C.bert_step(converted, tokenizer)
    values, lora, Y = _bert_values(inputs, targets, factors)
    owner, d = C.Owner(w.n_tokens), w.d
    ev = owner.evaluator(level)
    p, t = from_bert(w), Trained(blocks)
    run = Run(ev, lora, owner.roll, masks=values[d:])
    logits = train_forward(run, p, values[:d], t)
    grads = backward(run, p, loss_gradient(ev, logits, Y, m), owner.unroll, t)
    got = C.backward_record(grads, ev, owner)
    case = f"{blocks} {level}"
    C.assert_same(got, golden["bert_backward"][case], case)
    assert len(grads) == 6 * blocks
    if level < 10**6:
        assert ev.counts["refresh_rounds"] > 5
    assert all(_nonzero(got))


@pytest.mark.parametrize("level", C.BERT_ADAPTER)
def test_bert_adapter_gradients_equal_the_golden(
    golden: Any, converted: Any, tokenizer: object, level: int
) -> None:
    pytest.importorskip("transformers")
    from defense_suite.crypto.program.forward import encode
    from defense_suite.crypto.program.spec import from_bert

    w, inputs, targets, m, factors = C.bert_step(converted, tokenizer)
    values, lora, Y = _bert_values(inputs, targets, factors)
    d, slots = w.d, len(inputs[0])
    rng = np.random.default_rng(0)
    A, B = rng.normal(size=(d, 2)), rng.normal(size=(2, w.n_classes))
    owner = C.Owner(w.n_tokens)
    ev = owner.evaluator(level)
    p = from_bert(w)
    pooled = encode(Run(ev, lora, owner.roll, masks=values[d:]), p, values[:d])
    grads, _ = adapter_gradients(
        ev, p, pooled, C.encrypted(A, slots), C.encrypted(B, slots), Y, m
    )
    got = C.backward_record(grads, ev, owner)
    C.assert_same(got, golden["bert_adapter"][str(level)], str(level))
    assert all(_nonzero(got))
