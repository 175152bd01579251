"""Bring your own transformer: conversion of real ``transformers`` BERT models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture

transformers = pytest.importorskip("transformers")

from defense_suite.crypto.conversion import (  # noqa: E402
    ConversionError,
    HEBertConfig,
    convert,
)
from defense_suite.crypto.he.approx import RangeError  # noqa: E402

BertConfig = transformers.BertConfig
Bert = transformers.BertForSequenceClassification


def _bert(**overrides: object) -> nn.Module:
    torch.manual_seed(0)
    settings: dict[str, object] = {
        "vocab_size": 40,
        "hidden_size": 12,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 20,
        "max_position_embeddings": 16,
        "num_labels": 3,
        "initializer_range": 0.3,
    }
    settings.update(overrides)
    model: nn.Module = Bert(BertConfig(**settings)).eval()
    return model


def _ids(n: int, length: int = 10, vocab: int = 40, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, (n, length))
    ids[:, 0] = 2
    return ids


def _uniform(model: nn.Module) -> nn.Module:
    """Zero every block's query and key: softmax and the kernel both average."""
    encoder = model.base_model.encoder  # type: ignore[union-attr]
    for layer in encoder.layer:  # type: ignore[union-attr]
        for lin in (layer.attention.self.query, layer.attention.self.key):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
    return model


def _source_equals_converted(
    model: nn.Module, he: nn.Module, ids: np.ndarray, mask: np.ndarray
) -> torch.Tensor:
    """Assert the converted model's logits equal the source's; return the source's."""
    with torch.no_grad():
        want = model(
            input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)
        ).logits.double()
        got = he(torch.as_tensor(ids), torch.as_tensor(mask).double())
    assert torch.allclose(got, want, atol=1e-5)
    return want


def test_weights_copied_and_every_substitution_reported() -> None:
    model = _bert()
    he, report = convert(model, n_tokens=10, rank=3)
    bert = model.bert  # type: ignore[attr-defined]
    layer = he.block_list()[1]
    theirs = bert.encoder.layer[1]
    assert torch.equal(layer.query.weight, theirs.attention.self.query.weight.double())
    assert torch.equal(layer.output_dense.bias, theirs.output.dense.bias.double())
    assert torch.equal(he.classifier.weight, model.classifier.weight.double())  # type: ignore[attr-defined]
    assert torch.equal(
        he.position_embeddings, bert.embeddings.position_embeddings.weight[:10].double()
    )
    assert layer.query.lora_a.shape == (12, 3)
    assert float(layer.query.lora_b.detach().abs().sum()) == 0.0
    assert he.config.n_layers == 2
    assert he.config.heads == 2
    where = " ".join(s.where for s in report.substitutions)
    for part in ("attention.self", "LayerNorm", "intermediate_act_fn", "pooler"):
        assert part in where
    # every source tensor except the unused positions is accounted for
    assert len(report.copied) == len({n for n, _ in model.named_parameters()})
    assert "Gaussian kernel" in str(report)


def test_uniform_attention_makes_the_exact_form_equal_the_source() -> None:
    """With Q = K = 0 softmax is uniform over attended keys, and so is the kernel.

    Then the converted model in exact mode (GELU kept) must reproduce the source's
    logits, padding mask included: every copied weight is wired where BERT uses it.
    """
    model = _uniform(_bert())
    he, _ = convert(model, n_tokens=10, activation="gelu")
    ids = _ids(6)
    mask = np.ones_like(ids)
    mask[:3, 7:] = 0
    want = _source_equals_converted(model, he, ids, mask)
    # and the mask matters: attending the padding changes the logits
    with torch.no_grad():
        unmasked = he(torch.as_tensor(ids))
    assert not torch.allclose(unmasked[:3], want[:3], atol=1e-3)


def test_polynomial_form_tracks_the_exact_form_and_the_guard_names_the_site() -> None:
    model = _bert()
    ids = _ids(64)
    errors = {}
    for activation, degree in (("relu", 8), ("gelu", 8), ("gelu", 16)):
        he, _ = convert(model, n_tokens=10, activation=activation, act_degree=degree)
        he.calibrate(ids, margin=1.5)
        with torch.no_grad():
            exact = he(torch.as_tensor(ids)).numpy()
        poly = he.predict_logits(ids)
        errors[activation, degree] = float(np.max(np.abs(poly - exact)))
        assert np.mean(poly.argmax(1) == exact.argmax(1)) >= 0.9
        assert not he.out_of_range(ids).any()
    # measured: 0.17 (ReLU's kink), 0.055 and 0.024 on logits of spread ~2
    assert errors["relu", 8] < 0.25
    assert errors["gelu", 16] < errors["gelu", 8] < 0.1
    # data unlike the calibration data leave the ranges: refused, site named
    narrow, _ = convert(model, n_tokens=10)
    same = np.full((8, 10), 7)
    same[:, 0] = 2
    narrow.calibrate(same)
    assert narrow.out_of_range(ids).any()
    with pytest.raises(RangeError, match=r"calibrated range.*"):
        narrow.predict_logits(ids)
    fresh, _ = convert(model, n_tokens=10)
    with pytest.raises(RuntimeError, match="calibrate"):
        fresh.predict_logits(ids)


def test_from_pretrained_folder_converts_like_the_object(tmp_path: Path) -> None:
    model = _bert(hidden_size=8, num_attention_heads=2, num_labels=2)
    model.save_pretrained(tmp_path)  # type: ignore[operator]
    loaded = Bert.from_pretrained(tmp_path)
    a, _ = convert(model, n_tokens=8)
    b, _ = convert(loaded, n_tokens=8)
    for (name, p), (_, q) in zip(
        a.named_parameters(), b.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name


class _Sneaky(transformers.models.bert.modeling_bert.BertIntermediate):  # type: ignore[misc]
    """Same name as BERT's layer, different function."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.dense(hidden_states))


_Sneaky.__name__ = "BertIntermediate"


def test_refusals_name_the_layer() -> None:
    with pytest.raises(ConversionError, match="causal decoder"):
        convert(_bert(is_decoder=True), n_tokens=8)
    with pytest.raises(ConversionError, match="BertForMaskedLM"):
        convert(transformers.BertForMaskedLM(BertConfig(**_small())), n_tokens=8)
    with pytest.raises(ConversionError, match="a list"):
        convert([1, 2], n_tokens=8)  # type: ignore[arg-type]
    model = _bert()
    model.bert.encoder.layer[1].intermediate.intermediate_act_fn = nn.SiLU()  # type: ignore[attr-defined]
    with pytest.raises(
        ConversionError, match=r"bert\.encoder\.layer\.1\.intermediate\.intermediate"
    ):
        convert(model, n_tokens=8)
    model = _bert()
    model.bert.encoder.layer[0].intermediate = _Sneaky(model.config)  # type: ignore[attr-defined]
    with pytest.raises(ConversionError, match=r"layer\.0\.intermediate'.*_convert"):
        convert(model, n_tokens=8)
    # a patched instance keeps its class but not its function
    patched = _bert()
    pooler = patched.bert.pooler  # type: ignore[attr-defined]
    pooler.forward = lambda hidden: torch.sin(hidden[:, 0])
    with pytest.raises(ConversionError, match=r"'bert\.pooler'.*forward is replaced"):
        convert(patched, n_tokens=8)
    hooked = _bert()
    norm = hooked.bert.encoder.layer[0].output.LayerNorm  # type: ignore[attr-defined]
    norm.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(ConversionError, match="_forward_hooks"):
        convert(hooked, n_tokens=8)
    # configured attention the blocks do not compute: a custom kernel, rotary or
    # relative positions
    for key, value, match in (
        ("_attn_implementation", "my_kernel", "my_kernel"),
        ("rope_theta", 10000.0, "rope_theta"),
        ("position_embedding_type", "relative_key", "relative_key"),
    ):
        configured = _bert()
        setattr(configured.config, key, value)
        with pytest.raises(ConversionError, match=match):
            convert(configured, n_tokens=8)
    with pytest.raises(ConversionError, match="SiLUActivation"):
        convert(_bert(hidden_act="silu"), n_tokens=8)
    with pytest.raises(ConversionError, match="num_labels=1"):
        convert(_bert(num_labels=1), n_tokens=8)
    with pytest.raises(ValueError, match="n_tokens"):
        convert(_bert(), n_tokens=17)
    with pytest.raises(ValueError, match="activation"):
        convert(_bert(), n_tokens=8, activation="swish")


def _small() -> dict[str, object]:
    return {
        "vocab_size": 40,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 8,
    }


def test_bad_ids_and_config() -> None:
    he, _ = convert(_bert(), n_tokens=10)
    with pytest.raises(ValueError, match="outside the embedding's vocabulary"):
        he.check_ids(np.full((2, 10), 40))
    with pytest.raises(ValueError, match=r"\(batch >= 1, 10\)"):
        he.check_ids(np.zeros((2, 11), dtype=np.int64))
    with pytest.raises(TypeError, match="integer token ids"):
        he.check_ids(np.zeros((2, 10)))
    with pytest.raises(ValueError, match="first"):
        he.check_ids(np.zeros((1, 10), dtype=np.int64), np.zeros((1, 10)))
    shape = {"vocab_size": 5, "n_tokens": 4, "d": 4, "heads": 2, "ffn": 4}
    shape |= {"n_layers": 1, "n_classes": 2}
    for bad, match in (
        ({"d": 10, "heads": 3}, r"HEBertConfig\.d=10 must be a multiple of heads=3"),
        ({"n_classes": 1}, r"HEBertConfig\.n_classes must be an int >= 2"),
        (
            {"layer_norm_eps": 0.0},
            r"HEBertConfig\.layer_norm_eps must be a finite number > 0\.0",
        ),
        ({"layer_norm_eps": float("nan")}, r"HEBertConfig\.layer_norm_eps"),
    ):
        with pytest.raises(ValueError, match=match):
            HEBertConfig(**{**shape, **bad})  # type: ignore[arg-type]


def test_roberta_shares_the_blocks_and_its_positions_skip_the_padding() -> None:
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=40,
        hidden_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=20,
        max_position_embeddings=14,
        num_labels=2,
        initializer_range=0.3,
        pad_token_id=1,
    )
    model = _uniform(transformers.RobertaForSequenceClassification(config).eval())
    with pytest.raises(ValueError, match="n_tokens"):
        convert(model, n_tokens=13)  # positions 2..13 fit 12 tokens
    he, report = convert(model, n_tokens=10, activation="gelu")
    assert he.config.position_padding_idx == 1
    assert "classifier.dense tanh" in str(report)
    ids = _ids(6)
    ids[:3, 6:] = 1  # right padding with RoBERTa's pad id
    _source_equals_converted(model, he, ids, (ids != 1).astype(np.int64))


def test_state_dict_round_trips_the_calibrated_model() -> None:
    model = _bert()
    he, _ = convert(model, n_tokens=10)
    ids = _ids(32)
    he.calibrate(ids)
    state = he.state_dict()
    copy, _ = convert(_bert(num_labels=3, initializer_range=0.01), n_tokens=10)
    with pytest.raises(RuntimeError, match="calibrate"):
        copy.predict_logits(ids)
    copy.load_state_dict(state)
    assert np.array_equal(copy.predict_logits(ids), he.predict_logits(ids))
    assert copy.calibration.ranges == he.calibration.ranges
