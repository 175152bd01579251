"""The federated task: non-IID clients with privacy groups, members and non-members.

A data set (digits, or the coarse-to-fine Gaussian mixture of :mod:`defenses.data`)
is split into a test set and a pool; the pool goes to the clients by Dirichlet label
skew (:func:`federated.partition.dirichlet_split`). Each client keeps
``member_fraction`` of its records for training (the members) and holds the rest out
(non-members from the same client distribution, for membership inference). Clients
are assigned to privacy groups in order ("strict", "moderate", "relaxed", ...) by
``group_fractions``, each group with its own epsilon budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_choice, check_int, check_real
from defenses.data import Dataset, load_digits, make_coarse_to_fine, stratified_split
from defenses.fields import Key, values_of

from .client import LocalData
from .partition import dirichlet_split
from .training import FederatedData

GROUP_NAMES = ("strict", "moderate", "relaxed", "loose", "open")
DATASETS = ("digits", "coarse_to_fine")
TEST_FRACTION = 0.2
"""Share of the data held out as the test set (the harness game and the Flower app)."""


@dataclass(frozen=True)
class FederatedTask:
    """Clients' data, budgets and groups, and the membership candidates."""

    data: FederatedData
    budgets: tuple[float, ...]
    groups: tuple[str, ...]
    delta: float
    candidates: FloatArray
    candidate_labels: IntArray
    is_member: npt.NDArray[np.bool_]
    candidate_groups: npt.NDArray[np.str_]
    seed: int


def load_dataset(name: str, rng: np.random.Generator) -> Dataset:
    """Digits, or a 12-class coarse-to-fine mixture in 16 dimensions."""
    if name == "digits":
        return load_digits()
    if name == "coarse_to_fine":
        return make_coarse_to_fine(
            rng, n_coarse=4, fine_per_coarse=3, dim=16, per_class=150, fine_spread=0.8
        )
    raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")


def split_test(
    dataset: str, test_fraction: float, rng: np.random.Generator
) -> tuple[Dataset, IntArray, IntArray]:
    """The data set, its stratified test and pool indices (first draws of rng)."""
    data = load_dataset(dataset, rng)
    test_i, pool_i = stratified_split(data.y, [test_fraction, 1.0 - test_fraction], rng)
    return data, test_i, pool_i


def load_test_set(
    dataset: str, test_fraction: float, rng: np.random.Generator
) -> tuple[FloatArray, IntArray, int]:
    """Only the held-out test set of :func:`make_task` and the number of classes.

    The same first draws as :func:`make_task`, so the same test set; no client
    data is drawn.
    """
    data, test_i, _ = split_test(dataset, test_fraction, rng)
    return data.X[test_i], data.y[test_i], data.n_classes


def assign_groups(
    n_clients: int, budgets: Sequence[float], fractions: Sequence[float]
) -> tuple[tuple[float, ...], tuple[str, ...]]:
    """Budget and group name per client, groups filled in order by ``fractions``."""
    if len(budgets) != len(fractions) or not budgets:
        raise ValueError(
            f"give one fraction per budget group, got {len(budgets)} budgets and "
            f"{len(fractions)} fractions"
        )
    if len(budgets) > len(GROUP_NAMES):
        raise ValueError(f"at most {len(GROUP_NAMES)} groups, got {len(budgets)}")
    f = np.asarray(fractions, dtype=np.float64)
    if np.any(f <= 0) or not np.isclose(f.sum(), 1.0):
        raise ValueError(
            f"group_fractions must be positive and sum to 1, got {fractions}"
        )
    counts = np.floor(f * n_clients).astype(int)
    counts[np.argsort(-(f * n_clients - counts))[: n_clients - counts.sum()]] += 1
    per_client_budget: list[float] = []
    per_client_group: list[str] = []
    for b, name, c in zip(budgets, GROUP_NAMES, counts, strict=False):
        per_client_budget += [float(b)] * int(c)
        per_client_group += [name] * int(c)
    return tuple(per_client_budget), tuple(per_client_group)


def make_task(
    *,
    dataset: str,
    n_clients: int,
    alpha: float,
    budgets: Sequence[float],
    group_fractions: Sequence[float],
    delta: float,
    member_fraction: float,
    test_fraction: float,
    rng: np.random.Generator,
) -> FederatedTask:
    """Draw the split, the groups and the membership candidates."""
    data, test_i, pool_i = split_test(dataset, test_fraction, rng)
    parts = dirichlet_split(data.y[pool_i], n_clients, alpha, rng)
    client_budgets, groups = assign_groups(n_clients, budgets, group_fractions)
    clients: list[LocalData] = []
    cand: list[IntArray] = []
    member: list[npt.NDArray[np.bool_]] = []
    cgroup: list[str] = []
    for part, group in zip(parts, groups, strict=True):
        index = rng.permutation(pool_i[part])
        k = max(1, round(member_fraction * index.size))
        train, held = index[:k], index[k:]
        clients.append(LocalData(data.X[train], data.y[train], data.n_classes))
        take = min(train.size, held.size)
        cand += [train[:take], held[:take]]
        member += [np.ones(take, bool), np.zeros(take, bool)]
        cgroup += [group] * (2 * take)
    candidates = np.concatenate(cand)
    return FederatedTask(
        data=FederatedData(
            tuple(clients), data.X[test_i], data.y[test_i], data.n_classes
        ),
        budgets=client_budgets,
        groups=groups,
        delta=float(delta),
        candidates=data.X[candidates],
        candidate_labels=data.y[candidates],
        is_member=np.concatenate(member),
        candidate_groups=np.asarray(cgroup),
        seed=int(rng.integers(2**31 - 1)),
    )


def check_groups(
    budgets: Sequence[float],
    group_fractions: Sequence[float],
    budgets_name: str,
    fractions_name: str,
) -> None:
    """Raise ValueError unless the privacy groups are well formed.

    There must be 1 to ``len(GROUP_NAMES)`` budgets, each finite and > 0, and one
    fraction per budget, each > 0, summing to 1. Messages name ``budgets_name`` and
    ``fractions_name`` (a budget as ``budgets_name[i]``, quotes stripped), so the
    harness game names its fields and the Flower app its config keys.
    """
    if not 1 <= len(budgets) <= len(GROUP_NAMES):
        raise ValueError(
            f"{budgets_name} must list 1 to {len(GROUP_NAMES)} group budgets, "
            f"got {budgets!r}"
        )
    element = budgets_name.strip("'")
    for i, b in enumerate(budgets):
        check_real(f"{element}[{i}]", b, 0.0, open_low=True)
    if len(group_fractions) != len(budgets):
        raise ValueError(
            f"{fractions_name} must have one entry per budget of {budgets_name} "
            f"({len(budgets)}: {tuple(budgets)!r}), got {group_fractions!r}"
        )
    if any(not f > 0 for f in group_fractions) or not math.isclose(
        sum(group_fractions), 1.0
    ):
        raise ValueError(
            f"{fractions_name} must be positive and sum to 1, got {group_fractions!r}"
        )


@dataclass(frozen=True)
class TaskFields:
    """What a federated task is drawn from (:meth:`task`).

    The harness game (:class:`federated.scenario.FederatedGame`) and the Flower
    app's :class:`federated.flower.config.AppConfig` inherit these fields, so both
    draw the same task from the same seed.

    Parameters
    ----------
    dataset : {"digits", "coarse_to_fine"}
        Data set split across the clients.
    n_clients : int
        Number of clients.
    alpha : float
        Dirichlet label-skew concentration (smaller is more non-IID), > 0.
    budgets : sequence of float
        Epsilon budget of each privacy group, strictest first, each > 0.
    group_fractions : sequence of float
        Fraction of clients in each group (sums to 1).
    delta : float
        Target delta, in (0, 1).
    member_fraction : float
        Fraction of each client's records it trains on, in (0, 1).
    """

    dataset: str = "digits"
    n_clients: int = 10
    alpha: float = 0.5
    budgets: Sequence[float] = (1.0, 3.0, 8.0)
    group_fractions: Sequence[float] = (0.4, 0.3, 0.3)
    delta: float = 1e-5
    member_fraction: float = 0.8

    def task(self, n_clients: int, rng: np.random.Generator) -> FederatedTask:
        """:func:`make_task` over ``n_clients``, :data:`TEST_FRACTION` held out."""
        values = values_of(TaskFields, self) | {"n_clients": n_clients}
        return make_task(**values, test_fraction=TEST_FRACTION, rng=rng)

    def check_task_fields(self, key: Key, min_clients: int) -> None:
        """Raise ValueError, naming a field by ``key``, unless every field is valid.

        The budgets and fractions are kept as tuples, so a configuration read from
        TOML (lists) equals, and hashes as, one built in code.
        """
        check_choice(key("dataset"), self.dataset, DATASETS)
        check_int(key("n_clients"), self.n_clients, min_clients)
        check_real(key("alpha"), self.alpha, 0.0, open_low=True)
        check_groups(
            self.budgets, self.group_fractions, key("budgets"), key("group_fractions")
        )
        for name in ("budgets", "group_fractions"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("delta", "member_fraction"):
            check_real(
                key(name), getattr(self, name), 0.0, 1.0, open_low=True, open_high=True
            )
