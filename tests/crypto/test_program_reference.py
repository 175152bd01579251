"""The one program (crypto.program) against the stored goldens of the two programs
it replaced.

The goldens (:mod:`tests.crypto.golden`, ``heformer_forward.npz`` and
``bert_forward.npz``) hold what the pre-issue-41 HEFormer and converted-BERT
programs computed on these cases: the logits on every slot, the operation counts,
the public schedule (every request's kind, stage, levels and sizes) and a SHA-256
of every request's plaintexts, on chains of several lengths, with the key owner's
roll or the client's rolled inputs, with and without CKKS-like noise (the noise
is drawn per operation, so equal logits under noise mean the same operations in
the same order). Each test runs the live program and asks for the same records,
bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from defense_suite.crypto.he.evaluator import Evaluator, Value
from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.program import Run, forward, from_bert, from_heformer
from tests.crypto.golden import cases as C
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def tokenizer() -> object:
    """The goldens' BERT cases read their vocabulary (a trained one varies)."""
    pytest.importorskip("transformers")
    return C.fixed_tokenizer()


def _heformer(
    ev: Evaluator,
    w: Any,
    z: list[Value],
    lora: Any,
    roll: Any = None,
    rolled_z: list[list[Value]] | None = None,
) -> list[Value]:
    return forward(Run(ev, lora, roll, rolled_z), from_heformer(w), z)


def _records_match(got: dict[str, C.Record], golden: dict[str, C.Record]) -> None:
    assert got, "no cases ran"
    for case, record in got.items():
        C.assert_same(record, golden[case], case)


@pytest.mark.parametrize("which", ["micro_model", "micro_head", "tiny_model"])
def test_heformer_program_equals_the_golden(
    request: pytest.FixtureRequest,
    which: str,
    tiny_data: Any,
    micro_inputs: np.ndarray,
) -> None:
    model: HEFormer = request.getfixturevalue(which)
    X = tiny_data[1].X[:3] if which == "tiny_model" else micro_inputs[:4]
    got = C.heformer_forward_records({which: (model, X)}, _heformer)
    golden = C.load("heformer_forward")
    assert set(got) == {k for k in golden if k.startswith(f"{which} ")}
    _records_match(got, golden)
    assert "error" not in got[f"{which} True 0.0 1000000"][1]
    assert "error" in got[f"{which} False 0.0 5"][1]  # non-interactive, short chain


def test_bert_program_equals_the_golden(converted: Any, tokenizer: object) -> None:
    pytest.importorskip("transformers")
    from defense_suite.crypto.program.encoder import forward as bert_forward

    def direct(ev: Evaluator, w: Any, zv: Any, mv: Any, lora: Any, roll: Any) -> Any:
        return forward(Run(ev, lora, roll, masks=mv), from_bert(w), zv)

    golden = C.load("bert_forward")
    for program in (bert_forward, direct):
        got = C.bert_forward_records(converted, tokenizer, program)
        assert set(got) == set(golden)
        _records_match(got, golden)
    refreshed = sum(m["counts"].get("refresh_rounds", 0) for _, m in golden.values())
    assert refreshed > 0  # the short chains exercised the refresh groupings


@pytest.mark.parametrize("interactive", [True, False])
def test_heformer_simulate_equals_the_golden(
    micro_model: HEFormer, micro_inputs: np.ndarray, interactive: bool
) -> None:
    from defense_suite.crypto.program.heformer import simulate

    X, n = micro_inputs[:4], micro_model.config.n_tokens
    levels = 5 if interactive else 10**6
    arrays, meta = C.load("heformer_forward")[
        f"micro_model {interactive} 1e-06 {levels}"
    ]
    cls, got = simulate(
        micro_model, X, 1e-6, np.random.default_rng(0), levels, interactive
    )
    assert np.array_equal(cls, arrays["logits"][:, ::n].T)
    assert got == meta["counts"]
    assert interactive == (got.get("refresh_rounds", 0) > 0)


def test_bert_simulate_equals_the_golden(converted: Any, tokenizer: object) -> None:
    pytest.importorskip("transformers")
    from defense_suite.crypto.conversion.tokenizer import encode
    from defense_suite.crypto.program.inputs import simulate
    from tests.crypto.tiny_bert import texts

    ids, mask = encode(tokenizer, texts()[:3], converted)
    n, batch = converted.config.n_tokens, ids.shape[0]
    arrays, meta = C.load("bert_forward")["1e-06 5"]
    cls, got = simulate(converted, ids, mask, 5, 1e-6, np.random.default_rng(0))
    assert np.array_equal(cls, arrays["logits"][:, : batch * n : n].T)
    assert got == meta["counts"]
