"""Distillation of the converted model, and the user's tokenizer path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from defense_suite.crypto.conversion import convert  # noqa: E402
from defense_suite.crypto.conversion.distill import (  # noqa: E402
    DistillConfig,
    distill,
    teacher_logits,
)
from defense_suite.crypto.conversion.tokenizer import build_tokenizer, encode  # noqa: E402
from defense_suite.crypto.tasks import negation_texts  # noqa: E402


def _teacher(vocab: int = 40) -> nn.Module:
    torch.manual_seed(1)
    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=12,
        num_labels=2,
        initializer_range=0.5,
    )
    model: nn.Module = transformers.BertForSequenceClassification(config).eval()
    return model


def test_distillation_recovers_agreement_with_the_teacher() -> None:
    teacher = _teacher()
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 40, (200, 8))
    ids[:, 0] = 2
    labels = teacher_logits(teacher, ids).argmax(1)
    student, _ = convert(teacher, n_tokens=8)
    report = distill(
        student,
        teacher,
        ids[:120],
        labels[:120],
        config=DistillConfig(epochs=10, batch=40, lr=1e-2),
        evaluation=(ids[120:], labels[120:], None),
        generator=torch.Generator().manual_seed(0),
    )
    assert report.original_accuracy == 1.0  # the labels are the teacher's argmax
    # measured: 0.375 before, 0.71 after (a random teacher, 30 steps)
    assert report.after_agreement >= report.before_agreement + 0.2
    assert report.after_accuracy == report.after_agreement
    assert report.losses[-1] < report.losses[0]
    # the distilled model is calibrated on its data: the deployed (guarded) form runs
    assert student.predict_logits(ids[:120]).shape == (120, 2)
    assert report.out_of_range_after <= 8


def test_distill_bad_input() -> None:
    teacher = _teacher()
    student, _ = convert(teacher, n_tokens=8)
    ids = np.full((4, 8), 6)
    with pytest.raises(ValueError, match="labels or an evaluation set"):
        distill(student, teacher, ids)
    with pytest.raises(ValueError, match=r"y: labels must lie"):
        distill(student, teacher, ids, np.array([0, 1, 2, 0]))
    with pytest.raises(ValueError, match=r"DistillConfig\.scope"):
        DistillConfig(scope="everything")
    with pytest.raises(ValueError, match=r"DistillConfig\.margin"):
        DistillConfig(margin=1.0)


def test_user_tokenizer_built_saved_loaded_and_checked(tmp_path: Path) -> None:
    texts, _ = negation_texts(np.random.default_rng(0), 200)
    tokenizer = build_tokenizer(texts, vocab_size=200)
    tokenizer.save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    teacher = _teacher(vocab=len(tokenizer))
    model, _ = convert(teacher, n_tokens=12)
    ids, mask = encode(tokenizer, texts[:5], model)
    again, _ = encode(loaded, texts[:5], model)
    assert np.array_equal(ids, again)
    assert ids[0, 0] == tokenizer.cls_token_id
    # eight words + [CLS] + [SEP], then padding
    assert mask.sum(1).tolist() == [10] * 5
    assert np.all(ids[:, 10:] == tokenizer.pad_token_id)
    # a tokenizer with more tokens than the embedding has rows is refused
    small, _ = convert(_teacher(vocab=20), n_tokens=12)
    with pytest.raises(ValueError, match="does not match the model"):
        encode(tokenizer, texts[:2], small)
    # too long for the converted length: refused, never truncated
    with pytest.raises(ValueError, match=r"texts\[1\]: 22 tokens, longer"):
        encode(tokenizer, [texts[0], " ".join(["good"] * 20)], model)
    with pytest.raises(TypeError, match="sequence of str"):
        encode(tokenizer, "good film", model)
    with pytest.raises(ValueError, match="empty"):
        encode(tokenizer, [], model)
    with pytest.raises(ValueError, match="corpus"):
        build_tokenizer([])


def test_byo_benchmark_is_registered_and_reports_three_variants() -> None:
    from defense_suite.crypto.benchmark.byo import byo_benchmark
    from defenses import registry

    # the registry's discovery imports the package's one scenario module, which
    # registers the benchmark (a layer below the harness registers nothing)
    assert "defense_suite.crypto.scenario" in registry._builtin_modules()
    assert not any(".conversion" in m for m in registry._builtin_modules())
    from defense_suite.crypto import scenario  # noqa: F401

    assert registry._registry["benchmarks"]["crypto-byo"] is byo_benchmark
    bench = byo_benchmark
    params = {
        "train": 120,
        "distill_train": 60,
        "test": 40,
        "width": 8,
        "ffn": 16,
        "epochs": 1,
        "distill_epochs": 1,
    }
    rows = list(bench(params, [0]))
    assert [r.defense for r in rows] == ["none", "converted", "distilled"]
    for r in rows:
        assert 0.0 <= r.utility["accuracy"] <= 1.0
        assert r.cost["plaintext_ms_per_seq"] > 0
    assert rows[0].utility["agreement"] == 1.0
    assert rows[2].cost["distill_s"] > 0
