"""The user's ClientApp: the mod, the training helper, the user's own loop.

On a SuperNode every privacy key comes from the node's own config (``epsilon``,
``delta``, ``num-server-rounds`` as ``rounds``, ``local-steps``, ``sigma``,
``spending``, ``save-fraction``, ``save-ratio``, ``accountant``), and so do its
data (``data-seed``: its partition and its public held-out split) and its public
record count (``public-num-examples``, the normalizer of the noised sum); in
Flower's simulation the run config stands in (a partition there is a function of
the run config). The DP noise and the Poisson sampling come from operating-system
entropy (``make_private`` seeds them), never from the run's seed.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from defense_suite.federated.flower import (
    ClientPrivacy,
    NodeConfigError,
    TimeAdaptiveClient,
    TimeAdaptiveMod,
    in_simulation,
    node_privacy,
)

from .task import SmallCNN, accuracy, load_partition, load_test


def privacy(context: Context) -> ClientPrivacy:
    """The client's own budget: its node config (in simulation, its group's)."""
    node, run = dict(context.node_config), dict(context.run_config)
    stand_in = {
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
        stand_in["epsilon"] = budgets[pid * len(budgets) // n]
    return node_privacy(context, stand_in)  # a SuperNode ignores the stand-in


def data_seed(context: Context) -> int:
    """The seed of this node's data: its node config's (simulation: the run's)."""
    if "data-seed" in context.node_config:
        return int(context.node_config["data-seed"])
    if not in_simulation():
        raise NodeConfigError("this SuperNode's node config lacks 'data-seed'")
    return int(context.run_config["seed"])


def _data(context: Context) -> torch.utils.data.TensorDataset:
    pid = int(context.node_config["partition-id"])
    n = int(context.node_config["num-partitions"])
    return load_partition(pid, n, data_seed(context))


def public_count(context: Context) -> int | None:
    """The node's public record count (simulation: its partition's size)."""
    if "public-num-examples" in context.node_config:
        return int(context.node_config["public-num-examples"])
    return len(_data(context)) if in_simulation() else None


# evaluate="public": this app's evaluate uses only the node's public held-out
# images, cut from the same permutation as its partition (disjoint by
# construction; the mod checks it against every record the ledger charged)
mod = TimeAdaptiveMod(
    privacy,
    evaluate="public",
    public_examples=public_count,
    training_records=lambda context: _data(context).tensors[0],
    public_records=lambda context: load_test(data_seed(context)).tensors[0],
    disjoint_in_simulation=True,
)
app = mod.register(ClientApp(mods=[mod]))


@app.train()
def train(msg: Message, context: Context) -> Message:
    """DP-SGD on this client's own images, at the round its ledger granted."""
    rnd = TimeAdaptiveClient(privacy(context), context).round(msg)
    net = SmallCNN()
    net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    data = _data(context)
    model, optimizer, loader = rnd.make_private(  # noise and sampling: OS entropy
        net,
        torch.optim.SGD(net.parameters(), lr=float(context.run_config["lr"])),
        data,
        max_grad_norm=float(context.run_config["clip"]),
        public_examples=mod.public_examples(context),  # never len(data)
    )
    for X, y in rnd.batches(loader):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X), y)
        torch.autograd.backward(loss)
        optimizer.step()
    metrics = MetricRecord({"num-examples": 1})  # the mod sends the public count
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy of the global model on the node's public held-out images."""
    net = SmallCNN()
    net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    data = load_test(data_seed(context))
    metrics = MetricRecord({"num-examples": len(data), "accuracy": accuracy(net, data)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
