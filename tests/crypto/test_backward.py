"""One backward pass for both families, against the backward passes it replaces.

Each test runs the old pass (kept verbatim in :mod:`tests.crypto.backward_reference`)
and :mod:`crypto.program.backward` on NumpyBackend (float64, no noise) with a
recording key owner, and asks for bit-equal gradients, equal operation counts and
the same refresh schedule (stage, size, in order).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from defense_suite.crypto.he.evaluator import Evaluator, NumpyBackend, Value
from defense_suite.crypto.he.packing import roll_tokens
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
from defense_suite.crypto.program.steps import _prepare
from tests.crypto import backward_reference as ref
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture

Grads = dict[str, list[list[Value]]]


class Owner:
    """A key owner in float64 that logs every round trip (the public schedule)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.log: list[tuple[str, int]] = []
        self.ev: Evaluator | None = None

    def refresh(self, values: list[Value]) -> list[Value]:
        assert self.ev is not None
        self.log.append((self.ev.stage, len(values)))
        return [Value(np.array(v.handle)) for v in values]

    def roll(self, values: list[Value], copies: int) -> list[list[Value]]:
        self.log.append(("roll", len(values)))
        return [
            [Value(roll_tokens(np.asarray(v.handle), self.n, s)) for v in values]
            for s in range(copies)
        ]

    def unroll(self, rows: list[list[Value]]) -> list[Value]:
        self.log.append(("unroll", len(rows[0])))
        return [
            Value(sum(roll_tokens(np.asarray(rows[s][i].handle), self.n, -s)
                      for s in range(len(rows))))
            for i in range(len(rows[0]))
        ]  # fmt: skip

    def evaluator(self, max_level: int) -> Evaluator:
        self.ev = Evaluator(NumpyBackend(), max_level, self.refresh)
        return self.ev


def _encrypted(M: Any, slots: int) -> list[list[Value]]:
    return [[Value(np.full(slots, float(x))) for x in row] for row in np.asarray(M)]


def _plain(G: Grads) -> dict[str, np.ndarray]:
    return {
        k: np.array([[np.asarray(v.handle) for v in row] for row in M])
        for k, M in G.items()
    }


def _same(old: Grads, new: Grads) -> float:
    assert list(old) == list(new)  # same keys, same order
    a, b = _plain(old), _plain(new)
    for k in a:
        assert a[k].shape == b[k].shape, k
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


ARMS = [
    Arm("lora", "gk"),
    Arm("full", "gk"),
    Arm("lora", "softmax"),
    Arm("full", "softmax"),
]


def _heformer_pair(
    model: HEFormer, X: np.ndarray, y: np.ndarray, arm: Arm, max_level: int
) -> tuple[Grads, Grads, Owner, Owner, Evaluator, Evaluator]:
    net, _, packed, onehot, b = _prepare(model, X, y, arm)
    n, slots = net.n_tokens, len(packed[0])
    m = np.zeros(slots)
    m[: b * n : n] = 1.0 / b
    for name in net.trained:
        net.mats[name] = _encrypted(net.mats[name], slots)
    targets = [Value(t) for t in onehot]
    old_owner, new_owner = Owner(n), Owner(n)
    ev = old_owner.evaluator(max_level)
    logits, cache = ref.forward(ev, net, [Value(p) for p in packed], old_owner.roll)
    [logits] = ref.fit(ev, [logits], 1, "loss")
    dlog = [ev.mask(ev.sub(lg, t), m) for lg, t in zip(logits, targets, strict=True)]
    old = ref.backward(ev, net, cache, dlog, old_owner.unroll)
    p = net.program()
    ev2 = new_owner.evaluator(max_level)
    run = Run(ev2, net.secrets(), new_owner.roll)
    t = Trained(1, net.softmax)
    logits2 = train_forward(run, p, [Value(x) for x in packed], t)
    new = backward(run, p, loss_gradient(ev2, logits2, targets, m), new_owner.unroll, t)
    return old, new, old_owner, new_owner, ev, ev2


@pytest.mark.parametrize("arm", ARMS, ids=lambda a: f"{a.trained}-{a.attention}")
@pytest.mark.parametrize("max_level", [10**6, 3, 5])
def test_heformer_gradients_equal_the_old_pass(
    micro_model: HEFormer, micro_inputs: np.ndarray, arm: Arm, max_level: int
) -> None:
    X = micro_inputs[:4]
    y = np.array([0, 1, 1, 0])
    old, new, o1, o2, ev1, ev2 = _heformer_pair(micro_model, X, y, arm, max_level)
    assert _same(old, new) == 0.0
    assert ev1.counts == ev2.counts
    assert o1.log == o2.log
    if max_level == 3:
        assert ev2.counts["refresh_rounds"] > 10  # the short chain exercises fits
    assert any(np.abs(G).max() > 1e-6 for G in _plain(new).values())


def test_heformer_two_heads_tiny_model(tiny_model: HEFormer, tiny_data: Any) -> None:
    _, client = tiny_data
    X, y = client.X[:2], client.y[:2]
    for arm in (Arm("lora", "gk"), Arm("full", "softmax")):
        old, new, o1, o2, ev1, ev2 = _heformer_pair(tiny_model, X, y, arm, 3)
        assert _same(old, new) == 0.0
        assert ev1.counts == ev2.counts
        assert o1.log == o2.log


def _bert_setup(
    model: Any, tokenizer: object
) -> tuple[Any, list[np.ndarray], list[np.ndarray], np.ndarray, dict[str, Any]]:
    from defense_suite.crypto.conversion.tokenizer import encode
    from defense_suite.crypto.program.encoder import BertWeights, lora_factors
    from defense_suite.crypto.program.qkv_step import step_inputs
    from tests.crypto.tiny_bert import texts

    ids, mask = encode(tokenizer, texts()[-4:], model)
    assert (mask == 0).any(), "the batch must exercise the padding mask"
    slots = ids.shape[0] * model.config.n_tokens
    inputs, targets, m, _ = step_inputs(model, ids, mask, [1, 0, 1, 0], slots, False)
    return BertWeights.from_model(model), inputs, list(targets), m, lora_factors(model)


@pytest.mark.parametrize(("blocks", "max_level"), [(1, 10**6), (1, 7), (2, 7), (2, 4)])
def test_bert_qkv_gradients_equal_the_old_pass(
    converted: Any, tokenizer: object, blocks: int, max_level: int
) -> None:
    pytest.importorskip("transformers")
    from defense_suite.crypto.program.spec import from_bert

    w, inputs, targets, m, factors = _bert_setup(converted, tokenizer)
    d, n, slots = w.d, w.n_tokens, len(inputs[0])
    runs = []
    for _ in range(2):
        owner = Owner(n)
        values = [Value(np.array(v)) for v in inputs]
        lora = {k: _encrypted(M, slots) for k, M in factors.items()}
        runs.append((owner, owner.evaluator(max_level), values, lora))
    (o1, ev1, v1, lora1), (o2, ev2, v2, lora2) = runs
    Y1, Y2 = ([Value(np.array(t)) for t in targets] for _ in range(2))
    old = ref.lora_gradients(
        ev1, w, v1[:d], v1[d:], lora1, o1.roll, o1.unroll, Y1, m, blocks
    )
    p, t = from_bert(w), Trained(blocks)
    run = Run(ev2, lora2, o2.roll, masks=v2[d:])
    logits = train_forward(run, p, v2[:d], t)
    new = backward(run, p, loss_gradient(ev2, logits, Y2, m), o2.unroll, t)
    assert len(new) == 6 * blocks
    assert _same(old, new) == 0.0
    assert ev1.counts == ev2.counts
    assert o1.log == o2.log
    if max_level < 10**6:
        assert ev2.counts["refresh_rounds"] > 5
    assert all(np.abs(G).max() > 1e-6 for G in _plain(new).values())


@pytest.mark.parametrize("max_level", [10**6, 7])
def test_bert_adapter_gradients_equal_the_old_pass(
    converted: Any, tokenizer: object, max_level: int
) -> None:
    pytest.importorskip("transformers")
    from defense_suite.crypto.program.encoder import encode
    from defense_suite.crypto.program.forward import encode as program_encode
    from defense_suite.crypto.program.spec import from_bert

    w, inputs, targets, m, factors = _bert_setup(converted, tokenizer)
    d, n, slots = w.d, w.n_tokens, len(inputs[0])
    rng = np.random.default_rng(0)
    A, B = rng.normal(size=(d, 2)), rng.normal(size=(2, w.n_classes))
    out = []
    for use_old in (True, False):
        owner = Owner(n)
        ev = owner.evaluator(max_level)
        values = [Value(np.array(v)) for v in inputs]
        lora = {k: _encrypted(M, slots) for k, M in factors.items()}
        Y = [Value(np.array(t)) for t in targets]
        if use_old:
            pooled = encode(ev, w, values[:d], values[d:], lora, owner.roll)
            ga, gb = ref.head_gradients(
                ev, w, pooled, _encrypted(A, slots), _encrypted(B, slots), Y, m
            )
            grads = {"a": ga, "b": gb}
        else:
            run = Run(ev, lora, owner.roll, masks=values[d:])
            p = from_bert(w)
            pooled = program_encode(run, p, values[:d])
            grads, _ = adapter_gradients(
                ev, p, pooled, _encrypted(A, slots), _encrypted(B, slots), Y, m
            )
        out.append((grads, owner.log, dict(ev.counts)))
    assert _same(out[0][0], out[1][0]) == 0.0
    assert out[0][1] == out[1][1]
    assert out[0][2] == out[1][2]
