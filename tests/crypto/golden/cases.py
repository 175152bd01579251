"""The cases behind the stored goldens, shared by their generator and their tests.

Each case builds its inputs from the test fixtures, runs a program with a recording
key owner on NumpyBackend and reduces what it did to a record: arrays (logits,
gradient sums) and JSON (operation counts, the public schedule or refresh log, a
SHA-256 of every request's plaintexts). :mod:`tests.crypto.golden.make_golden` ran
the pre-issue-41 programs on these cases once and stored their records here
(``*.npz``); the tests run the live programs and ask for the same records, bit for
bit (``np.array_equal``, exact JSON equality).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path
from typing import Any

import numpy as np
import torch

from defense_suite.crypto.he.evaluator import DepthError, Evaluator, NumpyBackend, Value
from defense_suite.crypto.he.packing import pack, roll_tokens, unit
from defense_suite.crypto.models.heformer import HEFormer
from defense_suite.crypto.program.folding import Arm
from defense_suite.crypto.program.heformer import lora_factors
from defense_suite.crypto.program.steps import _prepare
from defense_suite.crypto.protocol.schedule import Recorder

HERE = Path(__file__).resolve().parent
Record = tuple[dict[str, np.ndarray], dict[str, Any]]
"""Arrays and JSON-able metadata of one case."""

ARMS = (
    Arm("lora", "gk"),
    Arm("full", "gk"),
    Arm("lora", "softmax"),
    Arm("full", "softmax"),
)
HEFORMER_BACKWARD = [(a, level) for level in (10**6, 3, 5) for a in ARMS]
"""(arm, chain) of the micro model's gradient cases."""
TINY_BACKWARD = [(Arm("lora", "gk"), 3), (Arm("full", "softmax"), 3)]
"""(arm, chain) of the two-head tiny model's gradient cases."""
BERT_BACKWARD = [(1, 10**6), (1, 7), (2, 7), (2, 4)]
"""(trained blocks, chain) of the converted BERT's Q/K/V gradient cases."""
BERT_ADAPTER = [10**6, 7]
"""Chains of the converted BERT's classifier-adapter cases."""
LEVELS = (5, 6, 7, 9, 10**6)
"""Chains of the forward cases (non-interactive HEFormer: 5, 10, 10**6)."""


def arm_name(arm: Arm) -> str:
    """``"lora-gk"`` ..."""
    return f"{arm.trained}-{arm.attention}"


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


class NoisyOwner(Recorder):
    """The schedule's recording key owner whose answers carry the backend's noise."""

    def __init__(self, n: int, backend: NumpyBackend) -> None:
        super().__init__(n, 1.0, lambda h: int(np.asarray(h).size))
        self.backend = backend

    def refresh(self, values: list[Value]) -> list[Value]:
        out = super().refresh(values)
        return [Value(self.backend._n(np.asarray(v.handle))) for v in out]

    def roll(self, values: list[Value], copies: int) -> list[list[Value]]:
        out = super().roll(values, copies)
        return [[Value(self.backend._n(np.asarray(v.handle))) for v in r] for r in out]


def encrypted(M: Any, slots: int) -> list[list[Value]]:
    """A matrix as the client uploads it: one replicated value per entry."""
    return [[Value(np.full(slots, float(x))) for x in row] for row in np.asarray(M)]


def plain(G: dict[str, list[list[Value]]]) -> dict[str, np.ndarray]:
    """Gradient sums as arrays (rows, cols, slots)."""
    return {
        k: np.array([[np.asarray(v.handle) for v in row] for row in M])
        for k, M in G.items()
    }


def fixed_tokenizer(folder: Path = HERE) -> object:
    """The tiny BERT's tokenizer with the vocabulary stored beside the goldens.

    Training a WordPiece vocabulary (:func:`~crypto.conversion.tokenizer.
    build_tokenizer`) breaks ties differently in each process, so the goldens' BERT
    cases read theirs from ``vocab.json``.
    """
    from tokenizers import models

    from defense_suite.crypto.conversion.tokenizer import build_tokenizer
    from tests.crypto.tiny_bert import texts

    tok: Any = build_tokenizer(texts(), vocab_size=120)
    vocab = json.loads((folder / "vocab.json").read_text())
    tok.backend_tokenizer.model = models.WordPiece(vocab, unk_token="[UNK]")
    return tok


def heformer_step(
    model: HEFormer, X: np.ndarray, y: np.ndarray, arm: Arm
) -> tuple[Any, list[Value], list[Value], np.ndarray]:
    """(net with encrypted trained matrices, inputs, targets, loss mask) of a step."""
    net, _, packed, onehot, b = _prepare(model, X, y, arm)
    n, slots = net.n_tokens, len(packed[0])
    m = np.zeros(slots)
    m[: b * n : n] = 1.0 / b
    for name in net.trained:
        net.mats[name] = encrypted(net.mats[name], slots)
    return net, [Value(p) for p in packed], [Value(t) for t in onehot], m


def bert_step(model: Any, tokenizer: object) -> tuple[Any, ...]:
    """(weights, inputs, targets, loss mask, factors) of a converted BERT's step."""
    from defense_suite.crypto.conversion.tokenizer import encode
    from defense_suite.crypto.program.encoder import BertWeights
    from defense_suite.crypto.program.encoder import lora_factors as bert_factors
    from defense_suite.crypto.program.qkv_step import step_inputs
    from tests.crypto.tiny_bert import texts

    ids, mask = encode(tokenizer, texts()[-4:], model)
    assert (mask == 0).any(), "the batch must exercise the padding mask"
    slots = ids.shape[0] * model.config.n_tokens
    inputs, targets, m, _ = step_inputs(model, ids, mask, [1, 0, 1, 0], slots, False)
    w = BertWeights.from_model(model)
    return w, inputs, list(targets), m, bert_factors(model)


def heformer_inputs(model: HEFormer, X: np.ndarray) -> tuple[list[Value], Any]:
    """Packed embeddings and replicated LoRA factors of an HEFormer's inference."""
    with torch.no_grad():
        z = model.embed_tokens(torch.as_tensor(X, dtype=torch.float64)).numpy()
    packed = [Value(p) for p in pack(z, z.shape[0] * model.config.n_tokens)]
    lora = {k: unit(lambda x: x, M) for k, M in lora_factors(model).items()}
    return packed, lora


def bert_inputs(converted: Any, tokenizer: object) -> tuple[Any, ...]:
    """(weights, features, key weights, factors) of a converted BERT's inference."""
    from defense_suite.crypto.conversion.tokenizer import encode
    from defense_suite.crypto.program.encoder import BertWeights
    from defense_suite.crypto.program.encoder import lora_factors as bert_factors
    from defense_suite.crypto.program.inputs import pack_inputs
    from tests.crypto.tiny_bert import texts

    ids, mask = encode(tokenizer, texts()[:3], converted)
    w = BertWeights.from_model(converted)
    z, masks, _ = pack_inputs(converted, ids, mask, ids.shape[0] * w.n_tokens)
    lora = {k: unit(lambda x: x, M) for k, M in bert_factors(converted).items()}
    return w, [Value(v) for v in z], [Value(m) for m in masks], lora


def backward_record(
    grads: dict[str, list[list[Value]]], ev: Evaluator, owner: Owner
) -> Record:
    """Gradient sums (keys in order), operation counts, the round-trip log."""
    arrays = {f"grad {k}": v for k, v in plain(grads).items()}
    meta = {"keys": list(grads), "counts": ev.counts, "log": owner.log}
    return arrays, json.loads(json.dumps(meta))


Program = Callable[[Evaluator, NoisyOwner], list[Value]]


def forward_record(
    program: Program, n: int, levels: int, noise: float, interactive: bool
) -> Record:
    """Logits, counts, the public schedule and a digest of every request's values.

    A program the chain cannot run records its ``DepthError`` message instead.
    """
    backend = NumpyBackend(noise, np.random.default_rng(0) if noise else None)
    owner = NoisyOwner(n, backend)
    ev = Evaluator(backend, levels, owner.refresh if interactive else None)
    owner.ev = ev
    try:
        logits = program(ev, owner)
    except DepthError as e:
        return {}, {"error": str(e)}
    digest = hashlib.sha256()
    for request in owner.values:
        for x in request:
            digest.update(repr(x.shape).encode() + np.ascontiguousarray(x).tobytes())
    meta = {
        "counts": ev.counts,
        "steps": [astuple(s) for s in owner.steps],
        "values": digest.hexdigest(),
    }
    arrays = {"logits": np.array([np.asarray(v.handle) for v in logits])}
    return arrays, json.loads(json.dumps(meta))


def save(name: str, records: dict[str, Record], folder: Path = HERE) -> Path:
    """Write ``records`` to ``folder / f"{name}.npz"`` (arrays, and the JSON)."""
    flat = {
        f"{case}/{k}": a
        for case, (arrays, _) in records.items()
        for k, a in arrays.items()
    }
    meta = {case: m for case, (_, m) in records.items()}
    path = folder / f"{name}.npz"
    savez: Any = np.savez_compressed  # its stub types ** as the allow_pickle flag
    savez(path, **flat, meta=np.array(json.dumps(meta, sort_keys=True)))
    return path


def load(name: str) -> dict[str, Record]:
    """The records :func:`save` wrote."""
    with np.load(HERE / f"{name}.npz", allow_pickle=False) as f:
        meta = json.loads(str(f["meta"]))
        out: dict[str, Record] = {case: ({}, m) for case, m in meta.items()}
        for key in f.files:
            if key != "meta":
                case, k = key.split("/", 1)
                out[case][0][k] = f[key]
    return out


def assert_same(got: Record, want: Record, case: str) -> None:
    """Bit for bit: every array ``np.array_equal``, the JSON exactly equal."""
    (ga, gm), (wa, wm) = got, want
    assert gm == wm, f"{case}: counts, schedule or values differ from the golden"
    assert sorted(ga) == sorted(wa), case
    for k in wa:
        assert ga[k].shape == wa[k].shape, f"{case}: {k}"
        assert np.array_equal(ga[k], wa[k]), f"{case}: {k} differs from the golden"


HEFormerForward = Callable[..., list[Value]]
"""``(ev, w, z, lora, roll=..., rolled_z=...)``: an HEFormer forward program."""


def heformer_forward_records(
    models: dict[str, tuple[HEFormer, np.ndarray]], forward: HEFormerForward
) -> dict[str, Record]:
    """``forward``'s records on every model, roll or rolled inputs, noise, chain."""
    from defense_suite.crypto.program.heformer import HEWeights

    records = {}
    for which, (model, X) in models.items():
        w = HEWeights.from_model(model)
        n = w.n_tokens
        z, lora = heformer_inputs(model, X)
        rolled = [[Value(roll_tokens(p.handle, n, s)) for p in z] for s in range(n)]
        for interactive in (True, False):
            for noise in (0.0, 1e-6):
                for level in LEVELS if interactive else (5, 10, 10**6):
                    program = _heformer_program(
                        forward, w, z, lora, rolled, interactive
                    )
                    key = f"{which} {interactive} {noise} {level}"
                    records[key] = forward_record(program, n, level, noise, interactive)
    return records


def _heformer_program(
    forward: HEFormerForward,
    w: Any,
    z: list[Value],
    lora: Any,
    rolled: list[list[Value]],
    interactive: bool,
) -> Program:
    """``forward`` with the key owner's roll, or on the client's rolled inputs."""

    def program(ev: Evaluator, owner: NoisyOwner) -> list[Value]:
        if interactive:
            return forward(ev, w, z, lora, roll=owner.roll)
        return forward(ev, w, z, lora, rolled_z=rolled)

    return program


def bert_forward_records(
    converted: Any, tokenizer: object, forward: Callable[..., list[Value]]
) -> dict[str, Record]:
    """``forward(ev, w, z, masks, lora, roll)``'s records on every noise and chain."""
    w, zv, mv, lora = bert_inputs(converted, tokenizer)
    records = {}
    for noise in (0.0, 1e-6):
        for level in LEVELS:
            records[f"{noise} {level}"] = forward_record(
                lambda ev, o: forward(ev, w, zv, mv, lora, o.roll),
                w.n_tokens,
                level,
                noise,
                True,
            )
    return records


StepRun = Callable[[HEFormer, np.ndarray, np.ndarray, Arm, int], Record]


def heformer_backward_records(
    micro: tuple[HEFormer, np.ndarray], tiny: tuple[HEFormer, Any], run: StepRun
) -> dict[str, Record]:
    """``run(model, X, y, arm, chain)``'s records on the micro and tiny models."""
    (model, inputs), (small, client) = micro, tiny
    X, y = inputs[:4], np.array([0, 1, 1, 0])
    records = {
        f"micro {arm_name(a)} {level}": run(model, X, y, a, level)
        for a, level in HEFORMER_BACKWARD
    }
    for a, level in TINY_BACKWARD:
        key = f"tiny {arm_name(a)} {level}"
        records[key] = run(small, client.X[:2], client.y[:2], a, level)
    return records
