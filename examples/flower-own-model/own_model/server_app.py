"""The user's ServerApp: FedAvg made time-adaptive by the strategy wrapper."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from defense_suite.federated.flower import TimeAdaptiveStrategy

from .task import SmallCNN, accuracy, load_test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train, evaluate on the held-out images, write the per-client summary."""
    seed = int(context.run_config["seed"])
    test = load_test(seed)
    with torch.random.fork_rng():  # seeded initial weights, global state untouched
        torch.manual_seed(seed)
        initial = ArrayRecord(SmallCNN().state_dict())

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = SmallCNN()
        net.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": accuracy(net, test)})

    strategy = TimeAdaptiveStrategy(FedAvg(fraction_evaluate=1.0))
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=int(context.run_config["num-server-rounds"]),
        evaluate_fn=evaluate,
    )
    path = os.environ.get("FEDERATED_RESULT_PATH")
    if path:
        final = result.evaluate_metrics_serverapp
        summary = {
            "status": "completed",
            "accuracy": float(final[max(final)]["accuracy"]),  # type: ignore[arg-type]
            "clients": strategy.final_summary(),
        }
        Path(path).write_text(json.dumps(summary), encoding="utf-8")
