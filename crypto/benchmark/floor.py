r"""What the default answer floor costs, and the channel it closes (issue 38).

Three measurements on a micro HEFormer (2 tokens of 3 features, d = 2, personal
head), each arm alternated with the other ``rounds`` times so that drift in the
machine's load hits both alike:

* **answers**: :func:`crypto.protocol.reaction.answer_times` (4 ciphertexts of 0.5 or
  0.5 * 2^150, doubled by additions) with ``answer_floor = 0`` and ``"auto"``:
  the median difference huge - small, the small answers' spread, and the
  answers a two-sided test would need to read one bit from the difference,
  :math:`n \approx (2 \cdot 1.96\, \sigma / \delta)^2` (one probe answer per
  session: as many sessions);
* **inference**: one encrypted inference session (``Client.predict``,
  ``INTERACTIVE``, 2 sequences) with each floor;
* **fine-tuning**: one encrypted LoRA step (``encrypted_step``, 4 sequences)
  with each floor.

Run ``python -m defense_suite.crypto.benchmark.floor [rounds]``; it writes one
JSON object. The numbers depend on the machine and its load: report them with it.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from ..he.ckks import INTERACTIVE
from ..models.heformer import HEFormer
from ..models.train import micro_model
from ..program.folding import Arm
from ..protocol.client import Client
from ..protocol.finetune import encrypted_step
from ..protocol.reaction import answer_times
from ..protocol.server import Server


def _answers(model: HEFormer, floor: Any, repeats: int) -> dict[str, float]:
    client = Client(model, INTERACTIVE, answer_floor=floor)
    out = answer_times(client, repeats)
    out["floor_per_unit"] = client.floor()
    return out


def _spread(model: HEFormer, repeats: int) -> float:
    """Standard deviation of the unpadded answer time on small plaintexts."""
    client = Client(model, INTERACTIVE, answer_floor=0.0)
    times = [answer_times(client, 1)["small"] for _ in range(repeats)]
    return statistics.stdev(times)


def run(rounds: int = 2, repeats: int = 10) -> dict[str, Any]:
    """The three measurements, each arm alternated ``rounds`` times."""
    torch.set_num_threads(1)
    model = micro_model()
    X = np.random.default_rng(0).random((4, 2, 3))
    y = np.array([0, 1, 1, 0])
    out: dict[str, Any] = {"rounds": rounds, "repeats": repeats}
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, floor in (("off", 0.0), ("auto", "auto")):
            got = _answers(model, floor, repeats)
            for key, value in got.items():
                samples.setdefault(f"answer_{key}_{name}", []).append(value)
            client = Client(model, INTERACTIVE, answer_floor=floor)
            client.floor()  # measured before the clock starts, once per client
            start = time.perf_counter()
            client.predict(Server.for_model(None, model, INTERACTIVE), X[:2])
            samples.setdefault(f"inference_s_{name}", []).append(
                time.perf_counter() - start
            )
            start = time.perf_counter()
            encrypted_step(model, X, y, 0.5, Arm("lora"), answer_floor=floor)
            samples.setdefault(f"step_s_{name}", []).append(time.perf_counter() - start)
    for key, values in samples.items():
        out[key] = statistics.median(values)
    for what in ("inference_s", "step_s"):
        out[f"{what}_ratio"] = out[f"{what}_auto"] / out[f"{what}_off"]
    sigma = _spread(model, max(repeats, 3))
    delta = abs(out["answer_difference_off"])
    out["answer_sigma_small_off"] = sigma
    out["answers_per_bit_off"] = (
        math.ceil((2 * 1.96 * sigma / delta) ** 2) if delta > 0 else math.inf
    )
    return out


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    sys.stdout.write(json.dumps(run(rounds), indent=1, sort_keys=True) + "\n")
