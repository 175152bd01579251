"""Benchmark ``crypto-layer``: the whole encrypted layer, interactive vs not.

One full layer (attention, LayerNorm, feed-forward, head) of a trained model runs
under CKKS between a :class:`~crypto.protocol.Client` and a public-context
:class:`~crypto.protocol.Server` on a few client sequences, in two configurations
(Rho et al., 2025, run theirs non-interactively with bootstrapping):

* ``none`` (interactive) - N = 8192, 5 levels of 30 bits; the client refreshes
  values between stages and returns the rolled copies of K and V;
* ``non-interactive`` - N = 32768, 26 levels of 30 bits (880 of the 881 bits the
  HE standard allows at 128-bit security): the client uploads its embeddings and
  their rolled copies once and the server evaluates the 24 levels alone.

Reported: agreement of the encrypted argmax with the plaintext polynomial model,
max logit error, refresh round trips, server seconds for the batch and per
sequence at full packing (a ciphertext holds N/2 / n sequences and costs the same
however many are used).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from crypto.benchmark.personalised import int_param, personalised_model
from crypto.ckks import INTERACTIVE, NON_INTERACTIVE, CKKSParams
from crypto.model import ModelConfig
from crypto.protocol import Client, Server
from crypto.tasks import digit_sequences
from crypto.train import predict_logits
from defenses.harness import measurement
from defenses.results import Result


def _serve(
    model: Any, X: np.ndarray, params: CKKSParams, interactive: bool
) -> dict[str, float]:
    start = time.perf_counter()
    client = Client(model, params)
    server = Server.for_model(client.public_context(), model, params)
    keygen = time.perf_counter() - start
    logits = client.predict(server, X, interactive=interactive)
    plain = predict_logits(model, X, guard=False)
    seconds = server.transcript.seconds[-1]
    capacity = params.slots // model.config.n_tokens
    return {
        "agreement": float(np.mean(logits.argmax(1) == plain.argmax(1))),
        "max_logit_error": float(np.max(np.abs(logits - plain))),
        "server_s": seconds,
        "ms_per_sequence_packed": 1000.0 * seconds / capacity,
        "keygen_s": keygen,
        "refresh_rounds": float(server.counts.get("refresh_rounds", 0)),
        "roll_rounds": float(server.counts.get("roll_rounds", 0)),
        "ct_ct_mul": float(server.counts.get("ct_ct_mul", 0)),
        "upload_mb": sum(m.nbytes for _, m in server.transcript.inbound) / 1e6,
        "poly_modulus_degree": float(params.poly_modulus_degree),
        "levels": float(params.levels),
        "log_q": float(params.log_q),
    }


def layer_benchmark(params: Mapping[str, Any], seeds: list[int]) -> Iterable[Result]:
    """The encrypted layer in both configurations, per seed."""
    d = int_param(params, "d", 4)
    batch = int_param(params, "batch", 8)
    epochs = int_param(params, "pretrain_epochs", 6)
    settings = {"d": d, "batch": batch}
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
            run = _serve(model, X, chain, interactive)
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
