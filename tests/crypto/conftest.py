"""Shared fixtures: one tiny trained model for the crypto tests, and a tiny BERT.

The session's models (:data:`SHARED`) are built once and handed to every test that
asks: a test that changed one in place would change every later test's inputs (the
goldens' among them). :func:`shared_models_unchanged` makes that loud: after each
test it compares each shared model it used with the fingerprint taken when the model
was built (:func:`fingerprint`: every parameter, buffer and plain attribute, through
dataclasses, dicts and lists), fails that test's teardown naming the fixture, and
puts the model back. Per-test deep copies would not fit: module-scoped fixtures
(a client, a server pair) hold these models.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

from defense_suite.crypto.models.heformer import HEFormer, ModelConfig
from defense_suite.crypto.models.train import TrainConfig, personalise, pretrain
from defense_suite.crypto.models.train import micro_model as build_micro
from defense_suite.crypto.tasks import Sequences, client_transform, digit_sequences
from tests.crypto.tiny_bert import N_TOKENS, texts

if TYPE_CHECKING:
    from defense_suite.crypto.conversion import HEBert


SHARED = ("tiny_model", "micro_model", "micro_head")
"""The session fixtures that hand the same mutable model to every test."""

_BUILT: dict[str, tuple[str, HEFormer]] = {}
"""Each shared model's fingerprint when built, and a deep copy to restore it from."""


def _state(obj: Any, seen: set[int], out: Any) -> None:
    """Feed ``obj``'s value into the hash ``out``: tensors and arrays by bytes.

    A value, not an identity: two aliases of one object hash as two equal values.
    """
    if isinstance(obj, torch.Tensor):
        out.update(f"T{obj.dtype}{tuple(obj.shape)}{obj.requires_grad}".encode())
        out.update(obj.detach().cpu().contiguous().numpy().tobytes())
        if obj.grad is not None:
            _state(obj.grad, seen, out)
        return
    if isinstance(obj, np.ndarray):
        out.update(f"A{obj.dtype}{obj.shape}".encode())
        out.update(np.ascontiguousarray(obj).tobytes())
        return
    if obj is None or isinstance(obj, bool | int | float | complex | str | bytes):
        out.update(f"{type(obj).__name__}:{obj!r};".encode())
        return
    if id(obj) in seen:  # a cycle (``seen`` holds the path from the root)
        out.update(b"<cycle>")
        return
    seen.add(id(obj))
    out.update(f"<{type(obj).__qualname__}".encode())
    if isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            out.update(f"{key!r}=".encode())
            _state(obj[key], seen, out)
    elif isinstance(obj, list | tuple | set | frozenset):
        items = sorted(obj, key=repr) if isinstance(obj, set | frozenset) else obj
        for item in items:
            _state(item, seen, out)
    elif hasattr(obj, "__dict__"):
        _state(vars(obj), seen, out)
    elif dataclasses.is_dataclass(obj):  # slots
        fields = dataclasses.fields(obj)
        _state({f.name: getattr(obj, f.name) for f in fields}, seen, out)
    seen.discard(id(obj))
    out.update(b">")


def fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of everything a step can move in ``model``.

    Parameters and buffers (dtype, shape, ``requires_grad``, bytes, ``grad``
    included) and every plain attribute of every submodule, walked through
    dataclasses, dicts, lists and objects (an object without attributes, such as a
    ``torch.Generator`` or a builtin function, counts by its type only).
    Equal for a deep copy; changed by any in-place update of a value.
    """
    out = hashlib.sha256()
    _state(model, set(), out)
    return out.hexdigest()


def _shared(name: str, model: HEFormer) -> HEFormer:
    """Register a built model: its training's last gradients dropped, fingerprinted."""
    model.zero_grad(set_to_none=True)
    _BUILT[name] = (fingerprint(model), copy.deepcopy(model))
    return model


def _restore(model: torch.nn.Module, saved: torch.nn.Module) -> None:
    """Put ``saved``'s values back into ``model`` in place (same objects)."""
    with torch.no_grad():
        for mine, theirs in zip(model.modules(), saved.modules(), strict=True):
            for key, value in vars(theirs).items():
                if key not in ("_parameters", "_buffers", "_modules"):
                    setattr(mine, key, copy.deepcopy(value))
            for kind in ("_parameters", "_buffers"):
                ours, stored = getattr(mine, kind), getattr(theirs, kind)
                for key, tensor in stored.items():
                    target = ours[key]
                    if tensor is not None and target is not None:
                        target.copy_(tensor)
                        target.requires_grad_(tensor.requires_grad)
                        grad = tensor.grad
                        target.grad = None if grad is None else grad.clone()


@pytest.fixture(autouse=True)
def shared_models_unchanged(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test (at teardown) that changed a shared model in place."""
    used = {n: request.getfixturevalue(n) for n in SHARED if n in request.fixturenames}
    yield
    changed = [n for n, model in used.items() if fingerprint(model) != _BUILT[n][0]]
    for name in changed:
        _restore(used[name], _BUILT[name][1])
    if changed:
        pytest.fail(
            f"{request.node.nodeid} changed the shared session fixture(s) "
            f"{', '.join(changed)} in place (restored for the next tests): "
            "work on copy.deepcopy(...) of a shared model"
        )


@pytest.fixture(scope="session")
def tiny_data() -> tuple[Sequences, Sequences]:
    data = digit_sequences()
    order = np.random.default_rng(0).permutation(len(data))
    return data.subset(order[:400]), client_transform(data.subset(order[400:560]))


@pytest.fixture(scope="session")
def tiny_model(tiny_data: tuple[Sequences, Sequences]) -> HEFormer:
    torch.set_num_threads(1)
    public, client = tiny_data
    g = torch.Generator().manual_seed(0)
    model = pretrain(
        public,
        ModelConfig(d=8, heads=1, ffn=8),
        g,
        TrainConfig(epochs=4, batch=128),
        TrainConfig(epochs=2, lr=3e-3, batch=128, penalty=10.0),
    )
    personalise(
        model, client.subset(np.arange(100)), g, TrainConfig(epochs=3, penalty=10.0)
    )
    return _shared("tiny_model", model)


@pytest.fixture(scope="session")
def micro_model() -> HEFormer:
    """A d = 2, two-token model: encrypted sessions of a few seconds."""
    torch.set_num_threads(1)
    return _shared("micro_model", build_micro(personal_head=False))


@pytest.fixture(scope="session")
def micro_head() -> HEFormer:
    """The micro model with a personal (secret, encrypted) head."""
    torch.set_num_threads(1)
    return _shared("micro_head", build_micro(personal_head=True))


@pytest.fixture(scope="session")
def micro_inputs() -> np.ndarray:
    """Sequences in the micro model's calibrated ranges (its training inputs)."""
    return np.random.default_rng(0).random((64, 2, 3))


@pytest.fixture(scope="module")
def tokenizer() -> object:
    """A WordPiece tokenizer trained on the tiny BERT's corpus."""
    pytest.importorskip("transformers")
    from defense_suite.crypto.conversion.tokenizer import build_tokenizer

    return build_tokenizer(texts(), vocab_size=120)


@pytest.fixture(scope="module")
def converted(tokenizer: object) -> HEBert:
    """A tiny 2-layer BERT (width 8, 2 heads), converted, LoRA B made nonzero."""
    transformers = pytest.importorskip("transformers")
    from defense_suite.crypto.conversion import convert
    from defense_suite.crypto.conversion.tokenizer import encode

    torch.manual_seed(1)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=12,
        max_position_embeddings=8,
        num_labels=2,
        initializer_range=0.3,
    )
    teacher: torch.nn.Module = transformers.BertForSequenceClassification(config).eval()
    he, _ = convert(
        teacher, n_tokens=N_TOKENS, generator=torch.Generator().manual_seed(0)
    )
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in he.lora_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    ids, mask = encode(tokenizer, texts(), he)
    he.calibrate(ids, mask)
    return he
