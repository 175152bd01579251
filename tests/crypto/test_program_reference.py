"""The unified program (crypto.program) against the two pre-issue-41 programs.

Same values bit for bit on the NumpyBackend (with and without CKKS-like noise),
same operation counts, and the same public schedule (every request's kind, stage,
levels and plaintexts) on chains of several lengths, for both model families.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from defense_suite.crypto.evaluator import DepthError, Evaluator, NumpyBackend, Value
from defense_suite.crypto.heval import HEWeights, lora_factors
from defense_suite.crypto.model import HEFormer
from defense_suite.crypto.packing import pack, roll_tokens, unit
from defense_suite.crypto.program import forward, from_bert, from_heformer
from defense_suite.crypto.schedule import Recorder
from tests.crypto import _old_programs as old
from tests.crypto.tiny_bert import texts
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture

LEVELS = (5, 6, 7, 9, 10**6)


class Owner(Recorder):
    """A recording key owner whose answers carry the backend's noise."""

    def __init__(self, n: int, backend: NumpyBackend) -> None:
        super().__init__(n, 1.0, lambda h: int(np.asarray(h).size))
        self.backend = backend

    def refresh(self, values: list[Value]) -> list[Value]:
        out = super().refresh(values)
        return [Value(self.backend._n(np.asarray(v.handle))) for v in out]

    def roll(self, values: list[Value], copies: int) -> list[list[Value]]:
        out = super().roll(values, copies)
        return [[Value(self.backend._n(np.asarray(v.handle))) for v in r] for r in out]


def _run(program: Any, n: int, levels: int, noise: float, interactive: bool) -> Any:
    """(logits, counts, steps, request values) of ``program(ev, owner)``."""
    backend = NumpyBackend(noise, np.random.default_rng(0) if noise else None)
    owner = Owner(n, backend)
    ev = Evaluator(backend, levels, owner.refresh if interactive else None)
    owner.ev = ev
    try:
        logits = program(ev, owner)
    except DepthError as e:
        return str(e)
    return [np.asarray(v.handle) for v in logits], ev.counts, owner.steps, owner.values


def _same(a: Any, b: Any) -> None:
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return
    (la, ca, sa, va), (lb, cb, sb, vb) = a, b
    assert len(la) == len(lb)
    assert all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))
    assert ca == cb
    assert sa == sb
    assert all(
        np.array_equal(x, y)
        for ra, rb in zip(va, vb, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


def _heformer_inputs(model: HEFormer, X: np.ndarray) -> tuple[list[Value], Any]:
    with torch.no_grad():
        z = model.embed_tokens(torch.as_tensor(X, dtype=torch.float64)).numpy()
    packed = [Value(p) for p in pack(z, z.shape[0] * model.config.n_tokens)]
    lora = {k: unit(lambda x: x, M) for k, M in lora_factors(model).items()}
    return packed, lora


@pytest.mark.parametrize("which", ["micro_model", "micro_head", "tiny_model"])
@pytest.mark.parametrize("interactive", [True, False])
@pytest.mark.parametrize("noise", [0.0, 1e-6])
def test_heformer_program_equals_the_old_one(
    request: pytest.FixtureRequest,
    which: str,
    interactive: bool,
    noise: float,
    tiny_data: Any,
    micro_inputs: np.ndarray,
) -> None:
    model: HEFormer = request.getfixturevalue(which)
    X = tiny_data[1].X[:3] if which == "tiny_model" else micro_inputs[:4]
    w = HEWeights.from_model(model)
    n = w.n_tokens
    z, lora = _heformer_inputs(model, X)
    rolled = [[Value(roll_tokens(p.handle, n, s)) for p in z] for s in range(n)]
    kw: dict[str, Any] = {"roll": None, "rolled_z": rolled}
    for levels in LEVELS if interactive else (5, 10, 10**6):

        def before(ev: Evaluator, owner: Owner) -> list[Value]:
            if interactive:
                kw.update(roll=owner.roll, rolled_z=None)
            return old.heformer_forward(ev, w, z, lora, **kw)

        def after(ev: Evaluator, owner: Owner) -> list[Value]:
            if interactive:
                kw.update(roll=owner.roll, rolled_z=None)
            return forward(ev, from_heformer(w), z, lora, **kw)

        reference = _run(before, n, levels, noise, interactive)
        _same(reference, _run(after, n, levels, noise, interactive))
        if levels == 10**6:
            assert not isinstance(reference, str)


@pytest.mark.parametrize("noise", [0.0, 1e-6])
def test_bert_program_equals_the_old_one(
    converted: Any, tokenizer: object, noise: float
) -> None:
    pytest.importorskip("transformers")
    from defense_suite.crypto.bert_pack import pack_inputs
    from defense_suite.crypto.heval_bert import BertWeights
    from defense_suite.crypto.heval_bert import forward as bert_forward
    from defense_suite.crypto.heval_bert import lora_factors as bert_factors
    from defense_suite.crypto.hf import encode

    ids, mask = encode(tokenizer, texts()[:3], converted)
    w = BertWeights.from_model(converted)
    n = w.n_tokens
    z, masks, _ = pack_inputs(converted, ids, mask, ids.shape[0] * n)
    zv, mv = [Value(v) for v in z], [Value(m) for m in masks]
    lora = {k: unit(lambda x: x, M) for k, M in bert_factors(converted).items()}
    refreshed = 0
    for levels in LEVELS:
        reference = _run(
            lambda ev, o: old.bert_forward(ev, w, zv, mv, lora, o.roll),
            n,
            levels,
            noise,
            True,
        )
        new = _run(
            lambda ev, o: bert_forward(ev, w, zv, mv, lora, o.roll),
            n,
            levels,
            noise,
            True,
        )
        _same(reference, new)
        direct = _run(
            lambda ev, o: forward(ev, from_bert(w), zv, lora, o.roll, masks=mv),
            n,
            levels,
            noise,
            True,
        )
        _same(reference, direct)
        assert not isinstance(reference, str)
        refreshed += reference[1].get("refresh_rounds", 0)
    assert refreshed > 0  # the short chains exercised the refresh groupings
