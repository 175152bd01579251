"""The unified program (crypto.program) against the two pre-issue-41 programs.

Same values bit for bit on the NumpyBackend (with and without CKKS-like noise),
same operation counts, and the same public schedule (every request's kind, stage,
levels and plaintexts) on chains of several lengths, for both model families.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from defense_suite.crypto.he.evaluator import (
    DepthError,
    Evaluator,
    NumpyBackend,
    Roll,
    Value,
)
from defense_suite.crypto.he.packing import pack, roll_tokens, unit
from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.program import Run, forward, from_bert, from_heformer
from defense_suite.crypto.program.encoder import BertWeights, BlockWeights, NormWeights
from defense_suite.crypto.program.heformer import HEWeights, gk_attention, lora_factors
from defense_suite.crypto.protocol.schedule import Recorder
from defenses.arrays import FloatArray
from tests.crypto.tiny_bert import texts
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture

LEVELS = (5, 6, 7, 9, 10**6)


# --- the programs before issue 41, verbatim (the reference) ------------------------


def old_heformer_forward(
    ev: Evaluator,
    w: HEWeights,
    z: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll | None = None,
    rolled_z: list[list[Value]] | None = None,
) -> list[Value]:
    """Encrypted (or simulated) logits on every slot; the CLS slots are the answer.

    Give ``roll`` (interactive: the key owner returns rolled fresh copies of K and V)
    or ``rolled_z`` (non-interactive: the client uploaded rolled copies of the
    embedding, and K, V are projected once per shift).
    """
    if (roll is None) == (rolled_z is None):
        raise ValueError("give exactly one of roll (interactive) or rolled_z")
    d, n = w.d, w.n_tokens
    if len(z) != d:
        raise ValueError(f"expected {d} feature values, got {len(z)}")
    z = ev.ensure(z, 2, "qkv")
    q = ev.lora(z, w.wq, lora["q_a"], lora["q_b"])
    if roll is not None:
        k = ev.lora(z, w.wk, lora["k_a"], lora["k_b"])
        v = ev.lora(z, w.wv, lora["v_a"], lora["v_b"])
        rolled = roll(k + v, n)
        ev.note("roll_rounds")
        ks, vs = [r[:d] for r in rolled], [r[d:] for r in rolled]
    else:
        assert rolled_z is not None
        if len(rolled_z) != n:
            raise ValueError(f"expected {n} rolled copies, got {len(rolled_z)}")
        ks, vs = [], []
        for zs in rolled_z:
            zs = ev.ensure(zs, 2, "qkv")
            ks.append(ev.lora(zs, w.wk, lora["k_a"], lora["k_b"]))
            vs.append(ev.lora(zs, w.wv, lora["v_a"], lora["v_b"]))
    flat = q + [x for r in ks for x in r] + [x for r in vs for x in r]
    flat = ev.ensure(flat, 5, "attention")
    q = flat[:d]
    ks = [flat[d + s * d : d + (s + 1) * d] for s in range(n)]
    vs = [flat[d + n * d + s * d : d + n * d + (s + 1) * d] for s in range(n)]
    attended = gk_attention(ev, q, ks, vs, w.heads, w.gk)
    attended = ev.ensure(attended, 1, "output projection")
    h = [ev.add(a, b) for a, b in zip(z, ev.linear(attended, w.wo), strict=True)]
    h = ev.ensure(h, 2, "LayerNorm statistics")
    centred = ev.linear(h, w.centre)
    s = ev.total([ev.square(c) for c in centred])
    [s] = ev.ensure([s], 2, "LayerNorm inverse sqrt")
    y = ev.poly(s, w.isqrt)
    s, y = ev.ensure([s, y], 3, "LayerNorm Newton")
    y = ev.mul(y, ev.shift(ev.neg(ev.mul(s, ev.square(y))), 3.0))
    both = ev.ensure([*centred, y], 1, "LayerNorm scale")
    u = [ev.mul(c, both[-1]) for c in both[:-1]]
    u = ev.ensure(u, 4, "feed-forward")
    hidden = [ev.poly(a, w.act) for a in ev.linear(u, w.w1)]
    ffn = ev.linear(hidden, w.w2)
    o = [ev.add(a, b) for a, b in zip(h, ffn, strict=True)]
    o = ev.ensure(o, 4, "head")
    pooled = [ev.poly(t, w.tanh) for t in _head(ev, o, w.pool, lora.get("pool"))]
    return _head(ev, pooled, w.classifier, lora.get("classifier"))


def _head(
    ev: Evaluator, xs: list[Value], public: FloatArray, secret: list[list[Value]] | None
) -> list[Value]:
    """A head matrix: public plaintext, or the client's encrypted personal one."""
    if secret is None:
        return ev.linear(xs, public)
    return [
        ev.total([ev.mul(xs[g], secret[g][f]) for g in range(len(xs))])
        for f in range(len(secret[0]))
    ]


def depth(coefficients: FloatArray) -> int:
    """Levels :meth:`~crypto.he.evaluator.Evaluator.poly` consumes for a polynomial."""
    return math.ceil(math.log2(len(coefficients)))


def affine(
    ev: Evaluator, xs: Sequence[Value], W: FloatArray, b: FloatArray
) -> list[Value]:
    r""":math:`y_f = \sum_g x_g W_{gf} + b_f` (public W and b; one level)."""
    return [
        ev.shift(y, float(bias)) for y, bias in zip(ev.linear(xs, W), b, strict=True)
    ]


def layer_norm(
    ev: Evaluator, x: list[Value], w: NormWeights, newton: int, stage: str
) -> list[Value]:
    """The polynomial LayerNorm of the module docstring on packed features."""
    x = ev.ensure(x, 2, f"{stage} statistics")
    centred = ev.linear(x, w.stats)
    scaled = ev.linear(x, w.out)
    sigma = ev.total([ev.square(c) for c in centred])
    [sigma] = ev.ensure([sigma], depth(w.isqrt), f"{stage} inverse sqrt")
    y = ev.poly(sigma, w.isqrt)
    for _ in range(newton):
        sigma, y = ev.ensure([sigma, y], 3, f"{stage} Newton")
        y = ev.mul(y, ev.shift(ev.neg(ev.mul(sigma, ev.square(y))), 1.5))
    both = ev.ensure([*scaled, y], 1, f"{stage} scale")
    return [
        ev.shift(ev.mul(s, both[-1]), float(b))
        for s, b in zip(both[:-1], w.beta, strict=True)
    ]


def _mapped(
    ev: Evaluator,
    x: list[Value],
    W: FloatArray,
    b: FloatArray,
    coefficients: FloatArray,
    stage: str,
) -> list[Value]:
    """``p(x W + b)``, refreshing ``x`` once if the chain allows, else in two steps."""
    need = 1 + depth(coefficients)
    if need + 1 <= ev.max_level:  # room for the next linear map too
        x = ev.ensure(x, need + 1, stage)
        return [ev.poly(t, coefficients) for t in affine(ev, x, W, b)]
    x = ev.ensure(x, 1, stage)
    pre = ev.ensure(affine(ev, x, W, b), depth(coefficients), f"{stage} polynomial")
    return [ev.poly(t, coefficients) for t in pre]


def _attention(
    ev: Evaluator,
    w: BertWeights,
    bw: BlockWeights,
    z: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll,
    i: int,
) -> list[Value]:
    """Block ``i``'s masked Gaussian-kernel attention, projected (``z``'s level + 1)."""
    d, n = w.d, w.n_tokens
    z = ev.ensure(z, 2, f"layer {i} qkv")
    proj = {}
    for name, W, b in (("q", bw.wq, bw.bq), ("k", bw.wk, bw.bk), ("v", bw.wv, bw.bv)):
        low = ev.lora(z, W, lora[f"layer {i} {name}_a"], lora[f"layer {i} {name}_b"])
        proj[name] = [ev.shift(y, float(c)) for y, c in zip(low, b, strict=True)]
    rolled = roll(proj["k"] + proj["v"], n)
    ev.note("roll_rounds")
    flat = proj["q"] + [x for r in rolled for x in r]
    flat = ev.ensure(flat, 5, f"layer {i} attention")
    q = flat[:d]
    copies = [flat[d + s * 2 * d : d + (s + 1) * 2 * d] for s in range(n)]
    ks = [c[:d] for c in copies]
    vs = [[ev.mul(x, masks[s]) for x in c[d:]] for s, c in enumerate(copies)]
    attended = gk_attention(ev, q, ks, vs, w.heads, bw.gk)
    return ev.ensure(attended, 1, f"layer {i} output projection")


def old_bert_forward(
    ev: Evaluator,
    w: BertWeights,
    z: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll,
) -> list[Value]:
    """Logits on every slot from the client's embeddings ``z`` (the CLS slots count).

    ``masks`` are the ``n`` key-weight values :math:`M_s` (module docstring);
    ``roll`` asks the key owner for rolled fresh copies of K and V.
    """
    pooled = bert_encode(ev, w, z, masks, lora, roll)
    pooled = ev.ensure(pooled, 1, "classifier")
    return affine(ev, pooled, w.classifier, w.classifier_bias)


def bert_encode(
    ev: Evaluator,
    w: BertWeights,
    z: list[Value],
    masks: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll,
) -> list[Value]:
    """The pooler's output on every slot (the encoder and the tanh pooler)."""
    d, n = w.d, w.n_tokens
    if len(z) != d:
        raise ValueError(f"expected {d} feature values, got {len(z)}")
    if len(masks) != n:
        raise ValueError(f"expected {n} key-weight values, got {len(masks)}")
    for i, bw in enumerate(w.blocks):
        attended = _attention(ev, w, bw, z, masks, lora, roll, i)
        projected = affine(ev, attended, bw.wo, bw.bo)
        h = [ev.add(a, b) for a, b in zip(z, projected, strict=True)]
        h = layer_norm(ev, h, bw.norm1, w.newton_steps, f"layer {i} LayerNorm 1")
        hidden = _mapped(ev, h, bw.w1, bw.b1, bw.act, f"layer {i} feed-forward")
        hidden = ev.ensure(hidden, 1, f"layer {i} feed-forward output")
        ffn = affine(ev, hidden, bw.w2, bw.b2)
        out = [ev.add(a, b) for a, b in zip(h, ffn, strict=True)]
        z = layer_norm(ev, out, bw.norm2, w.newton_steps, f"layer {i} LayerNorm 2")
    return _mapped(ev, z, w.pool, w.pool_bias, w.tanh, "pooler")


# --- the comparisons -------------------------------------------------------------


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
            return old_heformer_forward(ev, w, z, lora, **kw)

        def after(ev: Evaluator, owner: Owner) -> list[Value]:
            if interactive:
                kw.update(roll=owner.roll, rolled_z=None)
            return forward(Run(ev, lora, **kw), from_heformer(w), z)

        reference = _run(before, n, levels, noise, interactive)
        _same(reference, _run(after, n, levels, noise, interactive))
        if levels == 10**6:
            assert not isinstance(reference, str)


@pytest.mark.parametrize("noise", [0.0, 1e-6])
def test_bert_program_equals_the_old_one(
    converted: Any, tokenizer: object, noise: float
) -> None:
    pytest.importorskip("transformers")
    from defense_suite.crypto.conversion.tokenizer import encode
    from defense_suite.crypto.program.encoder import forward as bert_forward
    from defense_suite.crypto.program.encoder import lora_factors as bert_factors
    from defense_suite.crypto.program.inputs import pack_inputs

    ids, mask = encode(tokenizer, texts()[:3], converted)
    w = BertWeights.from_model(converted)
    n = w.n_tokens
    z, masks, _ = pack_inputs(converted, ids, mask, ids.shape[0] * n)
    zv, mv = [Value(v) for v in z], [Value(m) for m in masks]
    lora = {k: unit(lambda x: x, M) for k, M in bert_factors(converted).items()}
    refreshed = 0
    for levels in LEVELS:
        reference = _run(
            lambda ev, o: old_bert_forward(ev, w, zv, mv, lora, o.roll),
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
            lambda ev, o: forward(Run(ev, lora, o.roll, masks=mv), from_bert(w), zv),
            n,
            levels,
            noise,
            True,
        )
        _same(reference, direct)
        assert not isinstance(reference, str)
        refreshed += reference[1].get("refresh_rounds", 0)
    assert refreshed > 0  # the short chains exercised the refresh groupings


@pytest.mark.parametrize("interactive", [True, False])
def test_heformer_simulate_equals_the_old_program(
    micro_model: HEFormer, micro_inputs: np.ndarray, interactive: bool
) -> None:
    from defense_suite.crypto.program.heformer import simulate

    X = micro_inputs[:4]
    w = HEWeights.from_model(micro_model)
    n = w.n_tokens
    z, lora = _heformer_inputs(micro_model, X)
    rolled = [[Value(roll_tokens(p.handle, n, s)) for p in z] for s in range(n)]
    levels = 5 if interactive else 10**6

    def before(ev: Evaluator, owner: Owner) -> list[Value]:
        if interactive:
            return old_heformer_forward(ev, w, z, lora, roll=owner.roll)
        return old_heformer_forward(ev, w, z, lora, rolled_z=rolled)

    logits, counts, _, _ = _run(before, n, levels, 1e-6, interactive)
    cls, got = simulate(
        micro_model, X, 1e-6, np.random.default_rng(0), levels, interactive
    )
    assert np.array_equal(cls, np.stack([v[::n] for v in logits], axis=1))
    assert got == counts
    assert interactive == (counts.get("refresh_rounds", 0) > 0)


def test_bert_simulate_equals_the_old_program(
    converted: Any, tokenizer: object
) -> None:
    pytest.importorskip("transformers")
    from defense_suite.crypto.conversion.tokenizer import encode
    from defense_suite.crypto.program.encoder import lora_factors as bert_factors
    from defense_suite.crypto.program.inputs import pack_inputs, simulate

    ids, mask = encode(tokenizer, texts()[:3], converted)
    w = BertWeights.from_model(converted)
    n, batch = w.n_tokens, ids.shape[0]
    z, masks, _ = pack_inputs(converted, ids, mask, batch * n)
    zv, mv = [Value(v) for v in z], [Value(m) for m in masks]
    lora = {k: unit(lambda x: x, M) for k, M in bert_factors(converted).items()}
    logits, counts, _, _ = _run(
        lambda ev, o: old_bert_forward(ev, w, zv, mv, lora, o.roll), n, 5, 1e-6, True
    )
    cls, got = simulate(converted, ids, mask, 5, 1e-6, np.random.default_rng(0))
    assert np.array_equal(cls, np.stack([v[: batch * n : n] for v in logits], axis=1))
    assert got == counts
