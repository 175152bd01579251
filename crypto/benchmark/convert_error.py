r"""Benchmark ``crypto-convert-error``: encrypted logit error of a converted BERT.

Per depth (``layers``), width (``width``, FFN ``2 * width``, 2 heads) and seed, a
``transformers`` BERT is converted (:func:`~crypto.conversion.convert`) and run under
CKKS (:class:`~crypto.protocol.encoder_client.BertClient` and an in-process
:class:`~crypto.protocol.server.Server`, the ``INTERACTIVE`` chain: N 8192, 30-bit
scale, client-aided refreshes and rolls). Two kinds of model (``kind``):

* ``random``: random weights (``initializer_range``, 0.2), calibrated on the
  sampled sequences themselves (margin 1.25); ``wide``: the same with
  ``wide_initializer_range`` (0.3), wider ranges;
* ``distilled``: trained on the generated negation sentences as
  :mod:`~crypto.benchmark.byo` does (AdamW, softmax, GELU), converted and distilled
  (:func:`~crypto.conversion.distill.distill`), the held-out sentences encrypted.

Each row's error is :math:`e_i = \max_c |\hat z_{ic} - z_{ic}|`, the encrypted
logits :math:`\hat z` against the plaintext polynomial model's :math:`z`
(:meth:`~crypto.conversion.model.HEBert.predict_logits`, the function CKKS
evaluates); the row reports its maximum and 99th percentile over one packed batch,
the smallest top-2 margin of :math:`z`, and how many argmaxes changed. The table
:data:`crypto.conversion.error.MEASURED` quotes these maxima.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from defenses.checks import check_choice, check_int
from defenses.harness import measurement
from defenses.results import Result
from defenses.threads import torch_threads

from ..conversion import HEBert, convert
from ..he.ckks import INTERACTIVE
from ..protocol.encoder_client import BertClient
from ..protocol.server import Server

KINDS = ("random", "wide", "distilled")


def _ints(params: Mapping[str, Any], key: str, default: list[int]) -> list[int]:
    value = params.get(key, default)
    values = value if isinstance(value, list) else [value]
    return [check_int(f"benchmark parameter {key!r}", v, 1) for v in values]


def _random_model(
    layers: int, width: int, seed: int, settings: Mapping[str, Any]
) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=settings["vocab"],
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * width,
        max_position_embeddings=max(16, settings["n_tokens"]),
        num_labels=2,  # type: ignore[call-arg]  # a PreTrainedConfig kwarg
        initializer_range=settings["initializer_range"],
    )
    with torch.random.fork_rng():  # transformers initialises from the global RNG
        torch.manual_seed(seed)
        model: torch.nn.Module = BertForSequenceClassification(config)
    return model.eval()


def _wide_case(
    layers: int, width: int, seed: int, settings: Mapping[str, Any]
) -> tuple[HEBert, np.ndarray, np.ndarray]:
    wide = {**settings, "initializer_range": settings["wide_initializer_range"]}
    return _random_case(layers, width, seed, wide)


def _random_case(
    layers: int, width: int, seed: int, settings: Mapping[str, Any]
) -> tuple[HEBert, np.ndarray, np.ndarray]:
    model = _random_model(layers, width, seed, settings)
    n, k = settings["n_tokens"], settings["sequences"]
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, settings["vocab"], (k, n))
    ids[:, 0] = 2
    mask = np.ones_like(ids)
    lengths = rng.integers(2, n + 1, k)
    mask[np.arange(n)[None, :] >= lengths[:, None]] = 0
    ids[mask == 0] = 0
    he, _ = convert(model, n_tokens=n, generator=torch.Generator().manual_seed(seed))
    he.calibrate(ids, mask, margin=1.25)
    return he, ids, mask


def _distilled_case(
    layers: int, width: int, seed: int, settings: Mapping[str, Any]
) -> tuple[HEBert, np.ndarray, np.ndarray]:
    from ..conversion.distill import DistillConfig, distill
    from ..conversion.tokenizer import build_tokenizer, encode
    from ..tasks import negation_texts
    from .byo import _teacher, _train

    n_train, k = settings["train"], settings["sequences"]
    length = settings["n_tokens"] - 2  # words, with [CLS] and [SEP]
    texts, y = negation_texts(np.random.default_rng(seed), n_train + k, length=length)
    tokenizer = build_tokenizer(texts[:n_train], vocab_size=settings["vocab"])
    ids, mask = encode(tokenizer, texts, settings["n_tokens"])
    shape = {"width": width, "layers": layers, "heads": 2, "ffn": 2 * width}
    teacher = _teacher(
        {**shape, "n_tokens": settings["n_tokens"]}, len(tokenizer), seed
    )
    tr = slice(0, n_train)
    _train(teacher, ids[tr], mask[tr], y[tr], settings["epochs"], 2e-3, seed)
    he, _ = convert(
        teacher,
        n_tokens=settings["n_tokens"],
        generator=torch.Generator().manual_seed(seed),
    )
    distill(
        he,
        teacher,
        ids[tr],
        y[tr],
        mask[tr],
        DistillConfig(epochs=settings["distill_epochs"]),
        generator=torch.Generator().manual_seed(seed),
    )
    te = slice(n_train, None)
    keep = ~he.out_of_range(ids[te], mask[te])
    return he, ids[te][keep], mask[te][keep]


def _row(
    kind: str, layers: int, width: int, seed: int, settings: Mapping[str, Any]
) -> Result:
    case = {"random": _random_case, "wide": _wide_case}.get(kind, _distilled_case)
    he, ids, mask = case(layers, width, seed, settings)
    per_batch = INTERACTIVE.slots // he.config.n_tokens
    ids, mask = ids[:per_batch], mask[:per_batch]
    client = BertClient(he, INTERACTIVE)
    server = Server.for_model(None, he, INTERACTIVE)
    start = time.perf_counter()
    encrypted = client.predict(server, ids, mask=mask)
    seconds = time.perf_counter() - start
    plain = he.predict_logits(ids, mask)
    error = np.max(np.abs(encrypted - plain), axis=1)
    top = np.sort(plain, axis=1)
    margin = top[:, -1] - top[:, -2]
    return measurement(
        "crypto-convert-error",
        f"{kind} L{layers} d{width}",
        seed,
        utility={
            "max_abs_error": float(error.max()),
            "p99_abs_error": float(np.quantile(error, 0.99)),
            "mean_abs_error": float(error.mean()),
            "min_margin": float(margin.min()),
            "flips": float(np.sum(encrypted.argmax(1) != plain.argmax(1))),
            "sequences": float(ids.shape[0]),
        },
        cost={"encrypted_s_per_batch": seconds},
        params={**settings, "kind": kind, "layers": layers, "width": width},
    )


def convert_error_benchmark(
    params: Mapping[str, Any], seeds: list[int]
) -> Iterable[Result]:
    """One row per kind, depth, width and seed (see the module docstring)."""
    settings: dict[str, Any] = {
        "n_tokens": check_int("n_tokens", params.get("n_tokens", 8), 2),
        "sequences": check_int("sequences", params.get("sequences", 200), 1),
        "vocab": check_int("vocab", params.get("vocab", 120), 10),
        "train": check_int("train", params.get("train", 600), 1),
        "epochs": check_int("epochs", params.get("epochs", 10), 1),
        "distill_epochs": check_int(
            "distill_epochs", params.get("distill_epochs", 4), 1
        ),
        "initializer_range": float(params.get("initializer_range", 0.2)),
        "wide_initializer_range": float(params.get("wide_initializer_range", 0.3)),
    }
    kinds = params.get("kinds", list(KINDS))
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        check_choice("benchmark parameter 'kinds'", kind, KINDS)
    layers = _ints(params, "layers", [1, 2, 3])
    widths = _ints(params, "widths", [8, 16])
    with torch_threads(1):
        for seed in seeds:
            for kind in kinds:
                for depth in layers:
                    for width in widths:
                        yield _row(kind, depth, width, seed, settings)
