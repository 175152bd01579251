"""The release path's red team (issue 37): honest-looking rounds, crafted content.

The server sends each client its own honest round (rate, sigma, steps, round) and
only well-formed messages, but chooses the weights, the run config and the
requests' order. Each attack here is judged on what the client released:

* **overflow probes**: weights that push one record's, half the records' or every
  record's logits to +inf (their per-example gradients NaN); the client must answer
  every granted round with a finite update, never an error;
* **scale attack**: a model whose gradient is zero in many coordinates (zero
  features, or a zeroed head) makes those coordinates of the update pure noise of
  standard deviation ``lr sigma C sqrt(k) / B``; the server estimates it and reads
  ``B``, hence the client's record count, unless ``B`` comes from a public count;
* **the evaluate split chosen by the server**: a second run with another run-config
  seed, evaluate probes on the node's "public" split;
* **side channels**: reply time against the number of sampled records and the
  private record count (:mod:`tests.federated.redteam_timing`), the steps actually
  taken, the error categories;
* **transcripts**: two clients that differ in one record play the same malicious
  server; what they emit must have the same structure (kinds, shapes, dtypes,
  metric names and values) and be finite.

``python -m tests.federated.redteam`` prints these rows with the earlier attacks'.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvg

from defense_suite.federated.client import LocalData, StepPlan, local_train
from defense_suite.federated.flower import TimeAdaptiveStrategy
from defense_suite.federated.flower import app as package_app
from defense_suite.federated.flower.app import client_app, client_data, test_set
from defense_suite.federated.flower.config import AppConfig
from defense_suite.federated.store import fingerprints
from defense_suite.federated.training import accuracy_of
from tests.federated import redteam
from tests.federated import redteam_timing as timing
from tests.federated.loopback import LoopbackGrid, node_contexts

FMAX = float(np.finfo(np.float64).max)
TOLD_APART = 3.0
"""|z| above which the scale attack tells two record counts apart (p < 0.003)."""
PROBES = ("one record", "half the records", "every record")
PROBE_CONFIG = replace(redteam.CONFIG, rounds=4, local_steps=2)
PROBE_BUDGETS = (4.0, 8.0)
"""Larger budgets than the other attacks' so that four rounds are granted."""


def crafted(data: LocalData, probe: str) -> tuple[list[np.ndarray], int | None]:
    """Softmax weights whose logits overflow for the probe's records, and the target.

    With :math:`a` = half the largest float, :math:`W_{j0} = a` and
    :math:`b_0 = a (2 - t)` make the logit :math:`a (x_j + 2 - t)` overflow to +inf
    exactly for the records with :math:`x_j > t` (every term is finite): for "one
    record" ``t`` lies between the largest and the second largest value of a
    feature whose largest value is unique (the target is that record); for "half
    the records" ``t`` is a median; for "every record" the bias is +inf.
    """
    d, k = data.X.shape[1], data.n_classes
    W, b = np.zeros((d, k)), np.zeros(k)
    if probe == "every record":
        b[0] = np.inf
        return [W, b], None
    X, a = data.X, FMAX / 2
    target = None
    if probe == "one record":
        for j in range(d):
            top = np.sort(X[:, j])[::-1]
            if top[0] > top[1] > 0:
                t, target = (top[0] + top[1]) / 2, int(np.argmax(X[:, j]))
                break
        else:
            raise ValueError("no feature has a unique largest value")
    else:
        above = [
            abs(float(np.mean(X[:, i] > np.median(X[:, i]))) - 0.5) for i in range(d)
        ]
        j = int(np.argmin(above))
        t = float(np.median(X[:, j]))
    W[j, 0], b[0] = a, a * (2 - t)
    return [W, b], target


def overflow_counts(data: LocalData, probe: str) -> int:
    """How many records the probe's weights overflow (checked, not assumed)."""
    (W, b), _ = crafted(data, probe)
    with np.errstate(over="ignore", invalid="ignore"):
        logits = data.X @ W + b
    return int((~np.isfinite(logits)).any(axis=1).sum())


class Crafting(TimeAdaptiveStrategy):
    """The honest wrapper (honest rounds) sending the probe's weights every round."""

    def __init__(self, weights: Callable[[int], list[np.ndarray]]) -> None:
        super().__init__(FedAvg(fraction_evaluate=0.0, min_available_nodes=2))
        self.weights = weights

    def configure_train(self, server_round, arrays, config, grid):
        """The honest messages, each with the crafted weights of its node."""
        out = []
        for msg in super().configure_train(server_round, arrays, config, grid):
            node = msg.metadata.dst_node_id
            msg.content["arrays"] = ArrayRecord(self.weights(node - 100))
            out.append(msg)
        return out

    def aggregate_train(self, server_round, replies):
        """Keep every reply (the judge reads them); aggregate nothing."""
        got = list(replies)
        for msg in got:
            if msg.has_error():
                raise redteam.ClientFailure(msg.error.reason)
        return None, None


@contextlib.contextmanager
def neighbour(drop: dict[int, int]) -> Iterator[None]:
    """The package app's partitions with record ``drop[pid]`` removed (neighbours)."""
    original = package_app.client_data

    def patched(config: AppConfig, pid: int, count: int) -> LocalData:
        data = original(config, pid, count)
        if pid not in drop:
            return data
        keep = np.arange(len(data)) != drop[pid]
        return LocalData(data.X[keep], data.y[keep], data.n_classes)

    package_app.client_data = patched  # type: ignore[assignment]
    try:
        yield
    finally:
        package_app.client_data = original  # type: ignore[assignment]


def probe_nodes(run_id: int = 1, **extra: object) -> dict:
    """Deployment nodes with the probe config's agreements (budgets 4 and 8)."""
    contexts = node_contexts(
        2,
        PROBE_CONFIG.record(),
        **{
            str(i): redteam.agreement(b, PROBE_CONFIG, **extra)
            for i, b in enumerate(PROBE_BUDGETS)
        },
    )
    for context in contexts.values():
        context.run_id = run_id
    return contexts


def overflow_run(
    probe: str, drop_target: bool = False, run_id: int = 1
) -> tuple[LoopbackGrid, BaseException | None]:
    """The probe's weights in every round against the package app (deployment).

    Each call needs fresh node storage (or another ``run_id`` with budget left).
    """
    parts = [client_data(PROBE_CONFIG, pid, 2) for pid in range(2)]
    weights = [crafted(p, probe)[0] for p in parts]
    target = crafted(parts[0], probe)[1]
    drop = {0: target} if drop_target and target is not None else {}
    grid = LoopbackGrid(client_app, probe_nodes(run_id))
    server = redteam.strategy_server(Crafting(lambda pid: weights[pid]), 4)
    with neighbour(drop):
        try:
            server(grid, redteam.server_context(PROBE_CONFIG))
        except Exception as error:  # an error reply stops the run
            return grid, error
    return grid, None


def finite_replies(grid: LoopbackGrid) -> bool:
    """Every train reply's arrays are finite."""
    for sent, reply in zip(grid.sent, grid.replies, strict=True):
        if sent.metadata.message_type != "train" or reply.has_error():
            continue
        for record in reply.content.array_records.values():
            if not all(np.isfinite(a).all() for a in record.to_numpy_ndarrays()):
                return False
    return True


def transcript(grid: LoopbackGrid, node: int = 100) -> list[tuple]:
    """What ``node`` emitted, up to the noise: kinds, shapes, dtypes, metrics."""
    out: list[tuple] = []
    for sent, reply in zip(grid.sent, grid.replies, strict=True):
        if sent.metadata.dst_node_id != node:
            continue
        if reply.has_error():
            out.append(("error", reply.error.code, reply.error.reason))
            continue
        arrays = tuple(
            (name, tuple((a.shape, a.dtype.str) for a in r.to_numpy_ndarrays()))
            for name, r in reply.content.array_records.items()
        )
        metrics = tuple(
            (name, tuple(sorted(r.items())))
            for name, r in reply.content.metric_records.items()
        )
        out.append(("reply", arrays, metrics, tuple(reply.content.config_records)))
    return out


def overflow_outcome(probe: str) -> redteam.Outcome:
    """One probe's row: answers, finiteness, true epsilons (Opacus)."""
    grid, _ = overflow_run(probe)
    answers = redteam.answers([grid])
    label = "finite" if finite_replies(grid) else "NON-FINITE"
    count = overflow_counts(client_data(PROBE_CONFIG, 0, 2), probe)
    return redteam.Outcome(
        f"overflow probe: {probe} ({count} overflow), 4 rounds",
        [f"{a} ({label})" for a in answers],
        redteam.epsilons([grid]),
    )


def noise_coordinates(
    sizes: tuple[int, ...],
    releases: int,
    public: int | None,
    backend: str = "numpy",
    seed: int = 0,
    zero: int | None = None,
) -> list[np.ndarray]:
    """Per size: the pure-noise coordinates of ``releases`` updates, in units of
    the standard deviation a public count of 445 predicts (so 1.0 is expected).

    The data hold ``zero`` always-zero features (numpy) or the model has a zeroed
    head (Opacus), so those coordinates of the update are noise only. ``public``:
    the public count every client normalizes by; ``None``: its private size (the
    behaviour the attack broke).
    """
    rng = np.random.default_rng(seed)
    q, lr, sigma, clip = 0.3, 1.0, 1.0, 1.0
    if zero is None:
        zero = 4000 if backend == "numpy" else 1000
    out = []
    for n in sizes:
        X = np.zeros((n, zero + 4))
        X[:, zero:] = rng.normal(size=(n, 4))
        y = rng.integers(0, 3, n)
        data = LocalData(X, y, 3)
        count = n if public is None else public
        predicted = lr * sigma * clip / (q * 445)
        coords = []
        for r in range(releases):
            step = np.random.default_rng([seed, n, r])
            if backend == "numpy":
                W, _ = local_train(
                    [np.zeros((zero + 4, 3)), np.zeros(3)], data,
                    StepPlan(q, 1, sigma), lr=lr, clip=clip, rng=step,
                    public_count=count,
                )  # fmt: skip
                coords.append(W[:zero].ravel())
            else:
                coords.append(opacus_noise(data, q, sigma, clip, lr, count, step))
        out.append(np.concatenate(coords) / predicted)
    return out


def opacus_noise(
    data: LocalData,
    q: float,
    sigma: float,
    clip: float,
    lr: float,
    count: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """The first layer's update of a zeroed-head MLP, made private by make_private."""
    import torch

    from defense_suite.federated.flower.client import PrivateRound
    from defense_suite.federated.ledger import ClientPrivacy, Grant, PrivacyLedger

    torch.set_num_threads(1)
    privacy = ClientPrivacy(epsilon=50.0, delta=1e-5, rounds=1, steps=1, sigma=sigma)
    rnd = PrivateRound(Grant(1, q, sigma, 1), PrivacyLedger(privacy), rng, 0, count)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(data.X.shape[1], 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    ).double()
    with torch.no_grad():
        net[2].weight.zero_()
    before = net[0].weight.detach().clone()
    dataset = torch.utils.data.TensorDataset(
        torch.from_numpy(data.X), torch.from_numpy(data.y)
    )
    model, optimizer, loader = rnd.make_private(
        net, torch.optim.SGD(net.parameters(), lr=lr), dataset, max_grad_norm=clip
    )
    for xb, yb in rnd.batches(loader):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    assert rnd.taken == rnd.steps
    return (net[0].weight.detach() - before).numpy().ravel()


def scale_z(estimates: list[np.ndarray]) -> float:
    """z statistic of the two samples' standard deviations being equal."""
    a, b = estimates
    sa, sb = float(np.std(a)), float(np.std(b))
    se = math.sqrt(sa**2 / (2 * a.size) + sb**2 / (2 * b.size))
    return (sa - sb) / se


def scale_outcome(backend: str = "numpy", releases: int = 400) -> list[redteam.Outcome]:
    """The scale attack on 445 vs 444 records, public count vs private size."""
    rows = []
    for public, label in ((445, "public count 445"), (None, "private size")):
        z = scale_z(noise_coordinates((445, 444), releases, public, backend))
        verdict = "told apart" if abs(z) > TOLD_APART else "not told apart"
        rows.append(
            redteam.Outcome(
                f"scale attack ({backend}), 445 vs 444 records, {label}",
                [f"{verdict} (z = {z:.2f}, {releases} releases each)"],
                [],
            )
        )
    return rows


def server_chosen_split() -> tuple[redteam.Outcome, dict[str, int]]:
    """Run 1 trains; run 2 (another run-config seed) probes evaluate on every node.

    Returns the row and the overlaps with the records run 1 charged: of the split
    the node answered on (its own, from ``data-seed``) and of the split the
    server's seed would have chosen (the attack's target before the fix).
    """
    first, _ = redteam.honest_run(contexts=redteam.nodes(evaluate="public"))
    second = replace(redteam.CONFIG, seed=7)
    contexts = redteam.nodes(second, run_id=2, evaluate="public")
    grid = LoopbackGrid(client_app, contexts)
    charged = set(fingerprints(client_data(redteam.CONFIG, 0, 2).X))
    X_test, _, n_classes = test_set(second)
    params = package_app.initial_params(second, X_test.shape[1], n_classes)
    grid.send_and_receive([redteam.probe(n, ArrayRecord(params)) for n in (100, 101)])
    own_X, own_y, _ = test_set(redteam.CONFIG)
    replies = [r for r in grid.replies if not r.has_error()]
    same = all(
        next(iter(r.content.metric_records.values()))["accuracy"]
        == accuracy_of(params, own_X, own_y)
        for r in replies
    )
    overlaps = {
        "answered": len(charged & set(fingerprints(own_X))),
        "server": len(charged & set(fingerprints(X_test))),
    }
    note = (
        f"; the node's own split ({overlaps['answered']} charged records; the "
        f"server's split would hold {overlaps['server']})"
        + ("" if same else " MISMATCH")
    )
    row = redteam.Outcome(
        "evaluate on a split the server's seed chooses (run 2, seed 7)",
        [a + note for a in redteam.answers([grid], "evaluate")],
        redteam.epsilons([first, grid]),
    )
    return row, overlaps


def moved_split() -> redteam.Outcome:
    """The node's data seed changes between runs: its new split holds charged rows."""
    first, _ = redteam.honest_run(contexts=redteam.nodes(evaluate="public"))
    grid = LoopbackGrid(
        client_app, redteam.nodes(run_id=2, evaluate="public", **{"data-seed": 7})
    )
    X_test, _, n_classes = test_set(redteam.CONFIG)
    params = package_app.initial_params(redteam.CONFIG, X_test.shape[1], n_classes)
    grid.send_and_receive([redteam.probe(n, ArrayRecord(params)) for n in (100, 101)])
    return redteam.Outcome(
        "evaluate after the node's split moved onto charged records",
        redteam.answers([grid], "evaluate"),
        redteam.epsilons([first, grid]),
    )


def table() -> list[redteam.Outcome]:
    """Every release-path attack's row (each on fresh node storage)."""
    import os
    import tempfile

    rows = []
    for probe in PROBES:
        os.environ["DEFENSE_SUITE_STATE_DIR"] = tempfile.mkdtemp()
        rows.append(overflow_outcome(probe))
    rows += scale_outcome("numpy") + scale_outcome("opacus", releases=600)
    os.environ["DEFENSE_SUITE_STATE_DIR"] = tempfile.mkdtemp()
    rows.append(server_chosen_split()[0])
    os.environ["DEFENSE_SUITE_STATE_DIR"] = tempfile.mkdtemp()
    rows.append(moved_split())
    return rows + timing_rows()


def timing_rows() -> list[redteam.Outcome]:
    """Reply time against the records sampled (both backends) and the cost."""

    def row(label: str, stats: tuple[float, float, float]) -> redteam.Outcome:
        corr, few, many = stats
        said = f"correlation {corr:.3f}; median {few * 1e3:.3f} vs {many * 1e3:.3f} ms"
        return redteam.Outcome(label, [said], [])

    data = client_data(redteam.CONFIG, 0, 2)
    rows = [row("reply time vs sampled records (numpy, 200 rounds)",
                timing.numpy_timing(data))]  # fmt: skip
    opacus = timing.opacus_timing()
    where = (
        f"60 or 600 records, public count {timing.PUBLIC}, q {timing.Q}, "
        f"{timing.STEPS} steps, 200 rounds"
    )
    rows.append(row(f"reply time vs sampled records (opacus, padded; {where})",
                    opacus["padded"]))  # fmt: skip
    rows.append(row(f"reply time vs sampled records (opacus, old sampled batches; "
                    f"{where})", opacus["old"]))  # fmt: skip
    padded, sampled = timing.mlp_cost(data)
    said = f"{padded * 1e3:.2f} vs {sampled * 1e3:.2f} ms ({padded / sampled:.2f}x)"
    label = "cost per local_train call (MLP, Opacus), padded vs sampled rows"
    rows.append(redteam.Outcome(label, [said], []))
    return rows
