"""Write the goldens: the pre-issue-41 programs' records on the cases of :mod:`.cases`.

Run once, on a checkout that still holds the verbatim references
(``tests/crypto/backward_reference.py``: the backward passes as they stood at
commit 9770ea3; ``tests/crypto/test_program_reference.py``: the two forward
programs before the one program), with this folder copied into it::

    git archive 4ca150e | tar -x -C /tmp/old
    cp -r tests/crypto/golden /tmp/old/tests/crypto/
    cd /tmp/old && MAKE_GOLDEN=$PWD/../main/tests/crypto/golden \\
        /work/main/.venv/bin/python -m pytest -p no:cacheprovider -q \\
        tests/crypto/golden/make_golden.py

It writes ``vocab.json`` (the BERT cases' tokenizer), ``heformer_backward.npz``,
``bert_backward.npz``, ``bert_adapter.npz``, ``heformer_forward.npz`` and
``bert_forward.npz`` into the folder ``MAKE_GOLDEN``
names (the goldens the tests of :mod:`tests.crypto.test_backward` and
:mod:`tests.crypto.test_program_reference` read). Without ``MAKE_GOLDEN`` every
function here is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from defense_suite.crypto.he.evaluator import Value
from defense_suite.crypto.models.heformer import HEFormer
from tests.crypto.golden import cases as C
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture

OUT = os.environ.get("MAKE_GOLDEN")
pytestmark = pytest.mark.skipif(not OUT, reason="writes the goldens: MAKE_GOLDEN=dir")


@pytest.fixture(scope="module")
def tokenizer() -> object:
    """This process's trained vocabulary, stored (``vocab.json``) and read back."""
    pytest.importorskip("transformers")
    import json

    from defense_suite.crypto.conversion.tokenizer import build_tokenizer
    from tests.crypto.tiny_bert import texts

    vocab = build_tokenizer(texts(), vocab_size=120).get_vocab()
    (Path(str(OUT)) / "vocab.json").write_text(json.dumps(vocab, sort_keys=True))
    return C.fixed_tokenizer(Path(str(OUT)))


def _save(name: str, records: dict[str, C.Record]) -> None:
    path = C.save(name, records, Path(str(OUT)))
    print(f"{path}: {path.stat().st_size} bytes")


def _old_heformer_backward(
    model: HEFormer, X: Any, y: Any, arm: Any, level: int
) -> Any:
    from tests.crypto import backward_reference as ref  # type: ignore[attr-defined]

    net, z, targets, m = C.heformer_step(model, X, y, arm)
    owner = C.Owner(net.n_tokens)
    ev = owner.evaluator(level)
    logits, cache = ref.forward(ev, net, z, owner.roll)
    [logits] = ref.fit(ev, [logits], 1, "loss")
    dlog = [ev.mask(ev.sub(lg, t), m) for lg, t in zip(logits, targets, strict=True)]
    return C.backward_record(
        ref.backward(ev, net, cache, dlog, owner.unroll), ev, owner
    )


def test_heformer_backward(
    micro_model: HEFormer,
    micro_inputs: np.ndarray,
    tiny_model: HEFormer,
    tiny_data: Any,
) -> None:
    micro, tiny = (micro_model, micro_inputs), (tiny_model, tiny_data[1])
    _save(
        "heformer_backward",
        C.heformer_backward_records(micro, tiny, _old_heformer_backward),
    )


def test_bert_backward(converted: Any, tokenizer: object) -> None:
    pytest.importorskip("transformers")
    from tests.crypto import backward_reference as ref  # type: ignore[attr-defined]

    w, inputs, targets, m, factors = C.bert_step(converted, tokenizer)
    d, slots, records = w.d, len(inputs[0]), {}
    for blocks, level in C.BERT_BACKWARD:
        owner = C.Owner(w.n_tokens)
        ev = owner.evaluator(level)
        v = [Value(np.array(x)) for x in inputs]
        lora = {k: C.encrypted(M, slots) for k, M in factors.items()}
        Y = [Value(np.array(t)) for t in targets]
        grads = ref.lora_gradients(
            ev, w, v[:d], v[d:], lora, owner.roll, owner.unroll, Y, m, blocks
        )
        records[f"{blocks} {level}"] = C.backward_record(grads, ev, owner)
    _save("bert_backward", records)


def test_bert_adapter(converted: Any, tokenizer: object) -> None:
    pytest.importorskip("transformers")
    from defense_suite.crypto.program.encoder import encode  # type: ignore[attr-defined]
    from tests.crypto import backward_reference as ref  # type: ignore[attr-defined]

    w, inputs, targets, m, factors = C.bert_step(converted, tokenizer)
    d, slots, records = w.d, len(inputs[0]), {}
    rng = np.random.default_rng(0)
    A, B = rng.normal(size=(d, 2)), rng.normal(size=(2, w.n_classes))
    for level in C.BERT_ADAPTER:
        owner = C.Owner(w.n_tokens)
        ev = owner.evaluator(level)
        v = [Value(np.array(x)) for x in inputs]
        lora = {k: C.encrypted(M, slots) for k, M in factors.items()}
        Y = [Value(np.array(t)) for t in targets]
        pooled = encode(ev, w, v[:d], v[d:], lora, owner.roll)
        ga, gb = ref.head_gradients(
            ev, w, pooled, C.encrypted(A, slots), C.encrypted(B, slots), Y, m
        )
        records[str(level)] = C.backward_record({"a": ga, "b": gb}, ev, owner)
    _save("bert_adapter", records)


def test_heformer_forward(
    micro_model: HEFormer,
    micro_head: HEFormer,
    tiny_model: HEFormer,
    tiny_data: Any,
    micro_inputs: np.ndarray,
) -> None:
    from tests.crypto.test_program_reference import (  # type: ignore[attr-defined]
        old_heformer_forward,
    )

    models = {
        "micro_model": (micro_model, micro_inputs[:4]),
        "micro_head": (micro_head, micro_inputs[:4]),
        "tiny_model": (tiny_model, tiny_data[1].X[:3]),
    }
    records = C.heformer_forward_records(models, old_heformer_forward)
    _save("heformer_forward", records)


def test_bert_forward(converted: Any, tokenizer: object) -> None:
    pytest.importorskip("transformers")
    from tests.crypto.test_program_reference import (  # type: ignore[attr-defined]
        old_bert_forward,
    )

    records = C.bert_forward_records(converted, tokenizer, old_bert_forward)
    _save("bert_forward", records)
