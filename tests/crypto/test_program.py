"""The one encrypted program (crypto.program): family values, trace, refusals."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from defense_suite.crypto.he.evaluator import Evaluator, NumpyBackend, Value
from defense_suite.crypto.he.packing import pack, roll_tokens, unit
from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.models.train import predict_logits
from defense_suite.crypto.program import Program, Run, forward, from_heformer
from defense_suite.crypto.program.heformer import HEWeights, lora_factors
from defense_suite.crypto.program.simulation import SimulatedOwner
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture


def _inputs(model: HEFormer, X: np.ndarray) -> tuple[list[Value], Any]:
    import torch

    with torch.no_grad():
        z = model.embed_tokens(torch.as_tensor(X, dtype=torch.float64)).numpy()
    packed = [Value(p) for p in pack(z, z.shape[0] * model.config.n_tokens)]
    return packed, {k: unit(lambda x: x, M) for k, M in lora_factors(model).items()}


def _run(p: Program, z: list[Value], lora: Any, trace: Any, levels: int) -> Any:
    owner = SimulatedOwner(NumpyBackend(), p.n_tokens)
    ev = Evaluator(NumpyBackend(), levels, owner.refresh)
    return forward(Run(ev, lora, owner.roll, trace=trace), p, z), ev.counts


def test_heformer_is_a_bert_without_biases_norms_and_blocks(
    micro_model: HEFormer,
) -> None:
    p = from_heformer(HEWeights.from_model(micro_model))
    [b] = p.blocks
    assert p.family == "heformer"
    assert b.attention_norm is None
    assert b.output_norm is None
    assert b.ffn_norm is not None
    assert b.ffn_norm.beta is None
    assert all(lin.bias is None for lin in (b.q, b.k, b.v, b.o, b.w1, b.w2))
    assert p.head.pool.bias is None
    assert p.head.classifier.bias is None


@pytest.mark.parametrize("levels", [5, 10**6])
def test_the_trace_changes_nothing_and_explains_the_logits(
    micro_model: HEFormer, micro_inputs: np.ndarray, levels: int
) -> None:
    X = micro_inputs[:4]
    p = from_heformer(HEWeights.from_model(micro_model))
    z, lora = _inputs(micro_model, X)
    plain, plain_counts = _run(p, z, lora, None, levels)
    trace: dict[str, list[Value]] = {}
    logits, counts = _run(p, z, lora, trace, levels)
    assert counts == plain_counts
    assert all(
        np.array_equal(a.handle, b.handle) for a, b in zip(plain, logits, strict=True)
    )
    assert trace["logits"] == logits
    # what the backward pass reads (crypto.program.backward), under either policy
    names = {"input", "attended", "normed", "pre-activation", "hidden"}
    names |= {f"{x} low" for x in "qkv"} | {"head input", "pre-tanh"}
    assert names | {"pooled", "logits"} <= set(trace)
    n, d = p.n_tokens, p.d
    for h in range(p.heads):
        vs = [trace[f"head {h} v {s}"] for s in range(n)]
        assert [len(v) for v in vs] == [d // p.heads] * n
    # the classifier reads the traced pooler output: logits = pooled W_c
    pooled = np.stack([np.asarray(v.handle) for v in trace["pooled"]], axis=1)
    got = pooled @ p.head.classifier.weight
    want = np.stack([np.asarray(v.handle) for v in logits], axis=1)
    assert np.allclose(got, want, rtol=0, atol=1e-12)
    # and the traced program is the model: CLS logits equal the plaintext ones
    assert np.allclose(want[::n], predict_logits(micro_model, X), atol=1e-9)


def test_refusals(micro_model: HEFormer, micro_inputs: np.ndarray) -> None:
    p = from_heformer(HEWeights.from_model(micro_model))
    with pytest.raises(ValueError, match="kv_grouping"):
        replace(p, kv_grouping="rows")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="blocks"):
        replace(p, blocks=())
    z, lora = _inputs(micro_model, micro_inputs[:2])
    ev = Evaluator(NumpyBackend(), 10**6)
    n = p.n_tokens
    rolled = [[Value(roll_tokens(v.handle, n, s)) for v in z] for s in range(n)]
    deep = replace(p, blocks=p.blocks * 2)
    with pytest.raises(ValueError, match="one-block"):
        forward(Run(ev, lora, rolled_z=rolled), deep, z)
    with pytest.raises(ValueError, match="exactly one"):
        forward(Run(ev, lora), p, z)
    with pytest.raises(ValueError, match="feature values"):
        forward(Run(ev, lora, rolled_z=rolled), p, z[:1])
    with pytest.raises(ValueError, match="key-weight"):
        forward(Run(ev, lora, rolled_z=rolled, masks=z[:1]), p, z)


def test_pack_inputs_without_the_guard_packs_the_same(
    converted: Any, tokenizer: object
) -> None:
    pytest.importorskip("transformers")
    import copy

    from defense_suite.crypto.conversion.tokenizer import encode
    from defense_suite.crypto.he.approx import RangeError
    from defense_suite.crypto.program.inputs import pack_inputs
    from tests.crypto.tiny_bert import texts

    ids, mask = encode(tokenizer, texts()[:3], converted)
    narrow = copy.deepcopy(converted)
    narrow.calibrate(ids[:1], mask[:1], margin=1.01)
    slots = 2 * converted.config.n_tokens
    with pytest.raises(RangeError):
        pack_inputs(narrow, ids[1:], mask[1:], slots)
    z, m, batch = pack_inputs(narrow, ids[1:], mask[1:], slots, guard=False)
    z0, m0, batch0 = pack_inputs(converted, ids[1:], mask[1:], slots)
    assert batch == batch0 == 2
    assert all(np.array_equal(a, b) for a, b in zip(z + m, z0 + m0, strict=True))
    with pytest.raises(ValueError, match=r"vocabulary|shape|range"):
        pack_inputs(narrow, ids[1:] + 10**6, mask[1:], slots, guard=False)


def test_policy_refuses_bad_values() -> None:
    from defense_suite.crypto.program import INFERENCE, TRAINING

    with pytest.raises(ValueError, match=r"Policy\.fused must be a bool"):
        replace(INFERENCE, fused=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Policy\.tanh"):
        replace(TRAINING, tanh="")
    assert INFERENCE.stage(INFERENCE.tanh, _bert_like()) == "pooler polynomial"
    assert TRAINING.stage(TRAINING.tanh, _bert_like()) == "tanh"


def _bert_like() -> Program:
    """A one-block program of the BERT family (only its names are read)."""
    from defense_suite.crypto.program import Affine, Block, Head

    eye = np.eye(2)
    lin = Affine(eye)
    block = Block("layer 0 ", lin, lin, lin, lin, lin, eye[0], lin, eye[0])
    return Program("bert", 2, 2, 1, 2, (block,), Head(lin, eye[0], lin, "pooler"))
