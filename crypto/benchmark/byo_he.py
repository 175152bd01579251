"""The encrypted rows of ``crypto-byo``: the distilled BERT under CKKS (TenSEAL).

* ``encrypted``: one packed batch of held-out sequences (as many as one ciphertext
  holds, at most ``encrypted``) through :class:`~crypto.protocol.encoder_client.
  BertClient` and an in-process :class:`~crypto.protocol.server.Server` on the
  ``INTERACTIVE`` chain; accuracy, agreement with the distilled plaintext model, the
  largest logit error, time and traffic per sequence;
* ``lora_step``: one encrypted LoRA step of the classifier adapter
  (:func:`~crypto.program.head_step.encrypted_head_step`, ``INTERACTIVE_WIDE``: the
  slot sums need its 60-bit special prime) on ``lora_step`` sequences, beside the
  same step in plaintext (``torch`` autograd), and their largest difference;
* ``qkv_lora_step`` (setting ``qkv_lora_step``, 0 or absent: off): one encrypted
  step of the last encoder block's Q/K/V LoRA factors
  (:func:`~crypto.program.qkv_step.encrypted_qkv_step`, ``INTERACTIVE_WIDE``, the
  earlier blocks frozen) on that many sequences, beside the same step by ``torch``
  autograd, and their largest difference.

Sequences the range guard refuses are left out of the encrypted batch (the client
would refuse them before upload); their share is the row's ``out_of_range``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from defenses.harness import measurement
from defenses.results import Result

from ..he.ckks import INTERACTIVE, INTERACTIVE_WIDE
from ..program.head_step import encrypted_head_step, reference_head_step
from ..program.qkv_step import encrypted_qkv_step, reference_qkv_step
from ..protocol.encoder_client import BertClient
from ..protocol.server import Server

if TYPE_CHECKING:
    from ..conversion.model import HEBert


def encrypted_rows(
    student: HEBert,
    ids: np.ndarray,
    mask: np.ndarray,
    y: np.ndarray,
    settings: Mapping[str, Any],
    seed: int,
    common: Mapping[str, Any],
) -> list[Result]:
    """The ``encrypted`` and ``lora_step`` rows on held-out ``ids`` (see module)."""
    rows = []
    n = student.config.n_tokens
    keep = ~student.out_of_range(ids, mask)
    ids, mask, y = ids[keep], mask[keep], y[keep]
    per_batch = (INTERACTIVE.slots - INTERACTIVE.slots % n) // n
    k = min(int(settings["encrypted"]), per_batch, ids.shape[0])
    if k > 0:
        client = BertClient(student, INTERACTIVE, settings["answer_floor"])
        server = Server.for_model(None, student, INTERACTIVE)
        start = time.perf_counter()
        encrypted = client.predict(server, ids[:k], mask=mask[:k])
        seconds = time.perf_counter() - start
        plain = student.predict_logits(ids[:k], mask[:k])
        ex = client.exchanges[-1]
        rows.append(
            measurement(
                "crypto-byo",
                "encrypted",
                seed,
                utility={
                    "accuracy": float(np.mean(encrypted.argmax(1) == y[:k])),
                    "agreement": float(np.mean(encrypted.argmax(1) == plain.argmax(1))),
                    "out_of_range": float(1.0 - keep.mean()),
                    "max_abs_error": float(np.max(np.abs(encrypted - plain))),
                },
                cost={
                    "encrypted_s_per_batch": seconds,
                    "encrypted_s_per_seq": seconds / k,
                    "server_s_per_batch": ex.server_s,
                    "mb_per_seq": (ex.bytes_up + ex.bytes_down) / k / 1e6,
                    "mb_per_batch": (ex.bytes_up + ex.bytes_down) / 1e6,
                    "setup_mb": client.setup_bytes / 1e6,
                    "round_trips": float(ex.round_trips),
                    "refresh_rounds": float(ex.counts.get("refresh_rounds", 0)),
                },
                params={**common, "variant": "encrypted", "sequences": k},
            )
        )
    m = min(int(settings["lora_step"]), ids.shape[0])
    if m > 0:
        rng = np.random.default_rng(seed)
        c = student.config
        A = 0.1 * rng.normal(size=(c.d, 2))
        B = 0.1 * rng.normal(size=(2, c.n_classes))
        lr = 0.1
        plain_step = reference_head_step(student, ids[:m], y[:m], A, B, lr, mask[:m])
        enc_step = encrypted_head_step(
            student, ids[:m], y[:m], A, B, lr, INTERACTIVE_WIDE, mask[:m]
        )
        diff = max(
            float(np.max(np.abs(enc_step.a - plain_step.a))),
            float(np.max(np.abs(enc_step.b - plain_step.b))),
        )
        rows.append(
            _step_row(
                "lora_step",
                seed,
                diff,
                enc_step,
                plain_step.seconds,
                {**common, "sequences": m},
            )
        )
    m = min(int(settings.get("qkv_lora_step", 0)), ids.shape[0])
    if m > 0:
        rows.append(_qkv_row(student, ids[:m], mask[:m], y[:m], seed, common))
    return rows


def _qkv_row(
    student: HEBert,
    ids: np.ndarray,
    mask: np.ndarray,
    y: np.ndarray,
    seed: int,
    common: Mapping[str, Any],
) -> Result:
    """The ``qkv_lora_step`` row: the encrypted step beside ``torch`` autograd's."""
    lr = 0.1
    labels = np.asarray(y, dtype=np.int64)
    plain = reference_qkv_step(student, ids, labels, lr, mask)
    enc = encrypted_qkv_step(student, ids, labels, lr, INTERACTIVE_WIDE, mask)
    diff = max(
        float(np.max(np.abs(enc.factors[k] - plain.factors[k]))) for k in plain.factors
    )
    params = {**common, "sequences": ids.shape[0], "trained_blocks": list(enc.layers)}
    return _step_row("qkv_lora_step", seed, diff, enc, plain.seconds, params)


class _Step(Protocol):
    """An encrypted step's result: its wall seconds and its operation counts."""

    @property
    def seconds(self) -> float: ...

    @property
    def counts(self) -> Mapping[str, int]: ...


def _step_row(
    variant: str,
    seed: int,
    diff: float,
    encrypted: _Step,
    plain_seconds: float,
    params: Mapping[str, Any],
) -> Result:
    """A step row: the encrypted step's time and refreshes beside the plaintext's."""
    return measurement(
        "crypto-byo",
        variant,
        seed,
        utility={"max_abs_update_error": diff},
        cost={
            "encrypted_step_s": encrypted.seconds,
            "plaintext_step_ms": plain_seconds * 1e3,
            "refresh_rounds": float(encrypted.counts.get("refresh_rounds", 0)),
        },
        params={**params, "variant": variant},
    )
