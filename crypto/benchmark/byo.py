"""Benchmark ``crypto-byo``: bring your own transformer, converted and distilled.

Per seed: a tokenizer trained with ``tokenizers`` on the generated negation sentences
(:func:`~crypto.tasks.negation_texts`); a ``transformers``
``BertForSequenceClassification`` built from a config (softmax attention, GELU) and
trained as usual (AdamW, dropout); :func:`~crypto.conversion.convert`; then
:func:`~crypto.conversion.distill.distill` on the first ``distill_train`` training rows
with their labels. Three variants on the held-out split: ``none`` (the original model),
``converted`` (polynomial form, calibrated, before distillation) and ``distilled``; then
the distilled model encrypted (:mod:`~crypto.benchmark.byo_he`): ``encrypted`` (one
packed batch of held-out sequences under CKKS), ``lora_step`` (one encrypted LoRA step
of the classifier adapter) and ``qkv_lora_step`` (one encrypted step of the last block's
Q/K/V LoRA factors), each when its setting is > 0. ``answer_floor`` (default
``"auto"``, the protocol's padding) sets the key owner's answer floor for the
encrypted batch (:func:`~crypto.protocol.timing.floor_parameter`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from defenses.checks import check_int, int_param
from defenses.harness import measurement
from defenses.results import Result
from defenses.threads import torch_threads

from ..conversion import convert
from ..conversion.distill import DistillConfig, distill, teacher_logits
from ..conversion.tokenizer import build_tokenizer, encode
from ..protocol.timing import floor_parameter
from ..tasks import negation_texts
from .byo_he import encrypted_rows


def _teacher(settings: Mapping[str, Any], vocab: int, seed: int) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab,
        hidden_size=settings["width"],
        num_hidden_layers=settings["layers"],
        num_attention_heads=settings["heads"],
        intermediate_size=settings["ffn"],
        max_position_embeddings=max(16, settings["n_tokens"]),
        num_labels=2,  # type: ignore[call-arg]  # a PreTrainedConfig kwarg
    )
    with torch.random.fork_rng():  # transformers initialises from the global RNG
        torch.manual_seed(seed)
        model: torch.nn.Module = BertForSequenceClassification(config)
    return model


def _train(
    model: torch.nn.Module,
    ids: np.ndarray,
    mask: np.ndarray,
    y: np.ndarray,
    epochs: int,
    lr: float,
    seed: int,
) -> None:
    X, M, Y = (torch.as_tensor(a) for a in (ids, mask, y))
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    model.train()
    with torch.random.fork_rng():  # dropout draws from the global RNG: seeded here
        torch.manual_seed(seed)
        _epochs(model, optimiser, X, M, Y, epochs, g)
    model.eval()


def _epochs(
    model: torch.nn.Module,
    optimiser: torch.optim.Optimizer,
    X: torch.Tensor,
    M: torch.Tensor,
    Y: torch.Tensor,
    epochs: int,
    g: torch.Generator,
) -> None:
    for _ in range(epochs):
        order = torch.randperm(X.shape[0], generator=g)
        for start in range(0, X.shape[0], 32):
            i = order[start : start + 32]
            loss = model(input_ids=X[i], attention_mask=M[i], labels=Y[i]).loss
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()


def _run(settings: Mapping[str, Any], seed: int) -> list[Result]:
    n_train, n_test = settings["train"], settings["test"]
    texts, y = negation_texts(np.random.default_rng(seed), n_train + n_test)
    tokenizer = build_tokenizer(texts[:n_train], vocab_size=settings["vocab"])
    ids, mask = encode(tokenizer, texts, settings["n_tokens"])
    tr, te = slice(0, n_train), slice(n_train, None)
    teacher = _teacher(settings, len(tokenizer), seed)
    start = time.perf_counter()
    _train(teacher, ids[tr], mask[tr], y[tr], settings["epochs"], settings["lr"], seed)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    teacher_logits(teacher, ids[te], mask[te])
    teacher_ms = (time.perf_counter() - start) * 1e3 / n_test
    student, report = convert(
        teacher,
        n_tokens=settings["n_tokens"],
        activation=settings["activation"],
        generator=torch.Generator().manual_seed(seed),
    )
    config = DistillConfig(epochs=settings["distill_epochs"], lr=settings["distill_lr"])
    start = time.perf_counter()
    sub = slice(0, min(settings["distill_train"], n_train))
    result = distill(
        student,
        teacher,
        ids[sub],
        y[sub],
        mask[sub],
        config,
        evaluation=(ids[te], y[te], mask[te]),
        generator=torch.Generator().manual_seed(seed),
    )
    distill_s = time.perf_counter() - start
    start = time.perf_counter()
    student.predict_logits(ids[te], mask[te], guard=False)
    student_ms = (time.perf_counter() - start) * 1e3 / n_test
    common = {**settings, "substitutions": len(report.substitutions)}
    rows = {
        "none": (result.original_accuracy, 1.0, 0, {"train_s": train_s}, teacher_ms),
        "converted": (
            result.before_accuracy,
            result.before_agreement,
            result.out_of_range_before,
            {},
            student_ms,
        ),
        "distilled": (
            result.after_accuracy,
            result.after_agreement,
            result.out_of_range_after,
            {"distill_s": distill_s},
            student_ms,
        ),
    }
    plain = [
        measurement(
            "crypto-byo",
            variant,
            seed,
            utility={
                "accuracy": acc,
                "agreement": agree,
                "out_of_range": out / n_test,
            },
            cost={**extra, "plaintext_ms_per_seq": ms},
            params={**common, "variant": variant},
        )
        for variant, (acc, agree, out, extra, ms) in rows.items()
    ]
    return plain + encrypted_rows(
        student, ids[te], mask[te], y[te], settings, seed, common
    )


def byo_benchmark(params: Mapping[str, Any], seeds: list[int]) -> Iterable[Result]:
    """The original, converted and distilled model's held-out accuracy per seed."""
    settings: dict[str, Any] = {
        name: int_param(params, name, default)
        for name, default in (
            ("train", 2000),
            ("distill_train", 1000),
            ("test", 400),
            ("width", 32),
            ("layers", 2),
            ("heads", 2),
            ("ffn", 64),
            ("n_tokens", 12),
            ("vocab", 200),
            ("epochs", 15),
            ("distill_epochs", 10),
        )
    }
    for name in ("encrypted", "lora_step", "qkv_lora_step"):  # 0: not measured
        settings[name] = check_int(name, params.get(name, 0), 0)
    settings["lr"] = float(params.get("lr", 2e-3))
    settings["distill_lr"] = float(params.get("distill_lr", 3e-3))
    settings["activation"] = str(params.get("activation", "relu"))
    settings["answer_floor"] = floor_parameter(params)
    with torch_threads(1):
        for seed in seeds:
            yield from _run(settings, seed)
