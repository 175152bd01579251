"""Benchmark ``crypto-layer``: the whole encrypted layer, interactive vs not.

One full layer (attention, LayerNorm, feed-forward, head) of a trained model runs
under CKKS between a :class:`~crypto.protocol.client.Client` and a public-context
:class:`~crypto.protocol.server.Server` on a few client sequences, in two configurations
(Rho et al., 2025, run theirs non-interactively with bootstrapping):

* ``none`` (interactive) - N = 8192, 5 levels of 30 bits; the client refreshes
  values between stages and returns the rolled copies of K and V;
* ``non-interactive`` - N = 32768, 26 levels of 30 bits (880 of the 881 bits the
  HE standard allows at 128-bit security): the client uploads its embeddings and
  their rolled copies once and the server evaluates the 24 levels alone.

Reported: agreement of the encrypted argmax with the plaintext polynomial model,
max logit error, round trips per inference (the request plus every refresh or roll
the server asked for), the bytes sent each way (per sequence of the batch, and per
sequence at full packing: a ciphertext holds N/2 / n sequences and costs the same
however many are used; the session's context and LoRA upload apart as
``setup_mb``), and the server's seconds beside them. ``transport = "loopback"``
runs the server in another process over a socket on 127.0.0.1 (default: in-process).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from defenses.checks import int_param
from defenses.harness import measurement
from defenses.results import Result

from ..he.ckks import INTERACTIVE, NON_INTERACTIVE, CKKSParams
from ..models.heformer import ModelConfig
from ..models.train import predict_logits
from ..protocol.client import Client, Server
from ..protocol.transport import Loopback
from ..tasks import digit_sequences
from .personalised import personalised_model

TRANSPORTS = ("in-process", "loopback")


def _serve(
    model: Any, X: np.ndarray, params: CKKSParams, interactive: bool, transport: str
) -> dict[str, float]:
    start = time.perf_counter()
    client = Client(model, params)
    keygen = time.perf_counter() - start
    if transport == "loopback":
        with Loopback.for_model(model, params) as connection:
            logits = client.predict(connection, X, interactive=interactive)
    else:
        server = Server.for_model(None, model, params)
        logits = client.predict(server, X, interactive=interactive)
    plain = predict_logits(model, X, guard=False)
    [exchange] = client.exchanges
    b, capacity = X.shape[0], params.slots // model.config.n_tokens
    return {
        "agreement": float(np.mean(logits.argmax(1) == plain.argmax(1))),
        "max_logit_error": float(np.max(np.abs(logits - plain))),
        "server_s": exchange.server_s,
        "ms_per_sequence_packed": 1000.0 * exchange.server_s / capacity,
        "keygen_s": keygen,
        "refresh_rounds": float(exchange.counts.get("refresh_rounds", 0)),
        "roll_rounds": float(exchange.counts.get("roll_rounds", 0)),
        "round_trips": float(exchange.round_trips),
        "ct_ct_mul": float(exchange.counts.get("ct_ct_mul", 0)),
        "upload_mb": exchange.bytes_up / 1e6,
        "download_mb": exchange.bytes_down / 1e6,
        "setup_mb": client.setup_bytes / 1e6,
        "kb_up_per_sequence": exchange.bytes_up / 1e3 / b,
        "kb_down_per_sequence": exchange.bytes_down / 1e3 / b,
        "kb_up_per_sequence_packed": exchange.bytes_up / 1e3 / capacity,
        "kb_down_per_sequence_packed": exchange.bytes_down / 1e3 / capacity,
        "poly_modulus_degree": float(params.poly_modulus_degree),
        "levels": float(params.levels),
        "log_q": float(params.log_q),
    }


def layer_benchmark(params: Mapping[str, Any], seeds: list[int]) -> Iterable[Result]:
    """The encrypted layer in both configurations, per seed."""
    d = int_param(params, "d", 4)
    batch = int_param(params, "batch", 8)
    epochs = int_param(params, "pretrain_epochs", 6)
    transport = str(params.get("transport", "in-process"))
    if transport not in TRANSPORTS:
        raise ValueError(
            f"benchmark parameter transport must be one of {TRANSPORTS}, "
            f"got {transport!r}"
        )
    settings = {"d": d, "batch": batch, "transport": transport}
    data = digit_sequences()
    for seed in seeds:
        model, client = personalised_model(
            data, seed, ModelConfig(d=d, heads=1, ffn=d), epochs, 2, 300, 3
        )
        X = client.X[300 : 300 + batch]
        for name, chain, interactive in (
            ("none", INTERACTIVE, True),
            ("non-interactive", NON_INTERACTIVE, False),
        ):
            run = _serve(model, X, chain, interactive, transport)
            yield measurement(
                "crypto-layer",
                name,
                seed,
                utility={
                    "agreement": run.pop("agreement"),
                    "max_logit_error": run.pop("max_logit_error"),
                },
                cost=run,
                params={**settings, "variant": name},
            )
