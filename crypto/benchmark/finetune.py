"""Benchmark ``crypto-finetune``: one encrypted fine-tuning step, arm against arm.

Rho et al. (2025) report that fine-tuning with LoRA and Gaussian-kernel attention is
6.94x faster under HE than full fine-tuning with softmax attention. This benchmark
times one encrypted SGD step of the whole layer (:func:`crypto.protocol.finetune.
encrypted_step`, forward, backward and the server-side update) for each arm on the
same batch, the same model and the same key, one after the other in one process:

* ``lora-gk`` - LoRA factors of Q, K, V and the head encrypted and trained;
* ``none`` (``full-softmax``) - every weight matrix encrypted and trained,
  polynomial-softmax attention (the paper's baseline);
* optionally ``full-gk`` and ``lora-softmax``, which split the gain between LoRA and
  the kernel.

Each arm's updated weights are compared with the packed float64 simulation of the
same step (itself equal to torch autograd on the polynomial model for the kernel
arms, see ``tests/crypto/test_finetune.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from defenses.checks import int_param
from defenses.harness import measurement
from defenses.results import Result

from ..models.heformer import ModelConfig
from ..program.folding import Arm, initial_weights
from ..program.steps import TRAIN_PARAMS, simulated_step
from ..protocol.finetune import KeyOwner, encrypted_step
from ..tasks import digit_sequences
from .personalised import personalised_model

ARM_NAMES = ("lora-gk", "full-softmax", "full-gk", "lora-softmax")
BASELINE = "full-softmax"


def _arms(params: Mapping[str, Any]) -> list[str]:
    arms = list(params.get("arms", ["lora-gk", BASELINE]))
    bad = [a for a in arms if a not in ARM_NAMES]
    if bad or not arms:
        raise ValueError(
            f"benchmark parameter arms must be from {ARM_NAMES}, got {arms}"
        )
    return arms


def finetune_benchmark(params: Mapping[str, Any], seeds: list[int]) -> Iterable[Result]:
    """One encrypted fine-tuning step per arm, side by side, per seed."""
    d = int_param(params, "d", 8)
    heads = int_param(params, "heads", 1)
    ffn = int_param(params, "ffn", d * int_param(params, "ffn_ratio", 1))
    batch = int_param(params, "batch", 4)
    steps = int_param(params, "steps", 1)
    epochs = int_param(params, "pretrain_epochs", 3)
    lr = float(params.get("lr", 0.5))
    arms = _arms(params)
    settings = {"d": d, "heads": heads, "ffn": ffn, "batch": batch, "steps": steps}
    data = digit_sequences()
    for seed in seeds:
        model, client = personalised_model(
            data, seed, ModelConfig(d=d, heads=heads, ffn=ffn), epochs, 1, 200, 2
        )
        X, y = client.X[200 : 200 + batch], client.y[200 : 200 + batch]
        owner = KeyOwner(TRAIN_PARAMS, model.config.n_tokens)
        runs: dict[str, dict[str, float]] = {}
        for name in arms:
            trained, attention = name.split("-")
            arm = Arm(trained, attention)
            got = encrypted_step(model, X, y, lr, arm, steps, owner=owner)
            want = simulated_step(model, X, y, lr, arm, steps)
            before = initial_weights(model, arm)
            counts = got.counts
            runs[name] = {
                "step_s": got.seconds / steps,
                "step_cpu_s": got.cpu_seconds / steps,
                "step_diff": max(
                    float(np.max(np.abs(got.weights[k] - want.weights[k])))
                    for k in arm.names
                ),
                "update_size": max(
                    float(np.max(np.abs(want.weights[k] - before[k])))
                    for k in arm.names
                ),
                "encrypted_weights": float(sum(w.size for w in before.values())),
                **{
                    key: float(counts.get(key, 0)) / steps
                    for key in (
                        "ct_ct_mul",
                        "ct_pt_mul",
                        "slot_sums",
                        "polyval",
                        "refresh_rounds",
                        "refreshed_values",
                    )
                },
                "round_trips": float(
                    counts.get("refresh_rounds", 0)
                    + counts.get("roll_rounds", 0)
                    + counts.get("unroll_rounds", 0)
                )
                / steps,
            }
        base = runs.get(BASELINE, {}).get("step_s")
        for name, run in runs.items():
            utility = {"step_diff": run["step_diff"], "update_size": run["update_size"]}
            if base is not None:
                utility["speedup_vs_full_softmax"] = base / run["step_s"]
            yield measurement(
                "crypto-finetune",
                "none" if name == BASELINE else name,
                seed,
                utility=utility,
                cost={k: v for k, v in run.items() if k not in utility},
                params={**settings, "variant": name},
            )
