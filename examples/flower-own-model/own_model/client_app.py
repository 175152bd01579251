"""The user's ClientApp: the mod, the training helper, the user's own loop."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from defense_suite.federated.flower import (
    ClientPrivacy,
    TimeAdaptiveClient,
    TimeAdaptiveMod,
    privacy_from_config,
)

from .task import SmallCNN, accuracy, load_partition


def privacy(context: Context) -> ClientPrivacy:
    """The client's own budget: its node config, else its group's (simulation)."""
    node, run = dict(context.node_config), dict(context.run_config)
    defaults = {
        "delta": run["delta"],
        "rounds": run["num-server-rounds"],
        "local-steps": run["local-steps"],
        "sigma": run["sigma"],
        "spending": run["spending"],
        "save-fraction": run["save-fraction"],
        "save-ratio": run["save-ratio"],
    }
    if "epsilon" not in node:  # stand-in: three groups by partition
        budgets = [float(b) for b in str(run["budgets"]).split(",")]
        pid, n = int(node["partition-id"]), int(node["num-partitions"])
        defaults["epsilon"] = budgets[pid * len(budgets) // n]
    return privacy_from_config(node, defaults)


mod = TimeAdaptiveMod(privacy)
app = mod.register(ClientApp(mods=[mod]))


def _data(context: Context) -> torch.utils.data.TensorDataset:
    pid = int(context.node_config["partition-id"])
    n = int(context.node_config["num-partitions"])
    return load_partition(pid, n, int(context.run_config["seed"]))


@app.train()
def train(msg: Message, context: Context) -> Message:
    """DP-SGD on this client's own images, at the round its ledger granted."""
    rnd = TimeAdaptiveClient(privacy(context), context).round(msg)
    net = SmallCNN()
    net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    data = _data(context)
    g = torch.Generator().manual_seed(
        int(context.run_config["seed"]) * 10_000
        + context.node_id % 10_000
        + rnd.server_round
    )
    model, optimizer, loader = rnd.make_private(
        net,
        torch.optim.SGD(net.parameters(), lr=float(context.run_config["lr"])),
        data,
        max_grad_norm=float(context.run_config["clip"]),
        generator=g,
    )
    for X, y in rnd.batches(loader):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X), y)
        torch.autograd.backward(loss)
        optimizer.step()
    metrics = MetricRecord({"num-examples": len(data)})
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy of the global model on this client's own images."""
    net = SmallCNN()
    net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    data = _data(context)
    metrics = MetricRecord({"num-examples": len(data), "accuracy": accuracy(net, data)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
