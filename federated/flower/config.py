"""The run configuration of the package's own Flower app, validated before any start.

Every field of :class:`AppConfig` is declared in ``[tool.flwr.app.config]`` of
``pyproject.toml`` (hyphenated; ``rounds`` is Flower's ``num-server-rounds``), so
each can be overridden with ``flwr run --run-config``. :meth:`AppConfig.from_mapping`
checks every value's type (an int field takes only an int, a bool field only a
bool, a list only comma-separated numbers) and ``__post_init__`` every range, list
length and name, each error naming the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from defenses.checks import check_choice, check_int, check_real

from ..ledger import ClientPrivacy
from ..schedule import check_saving
from ..tasks import TaskFields, assign_groups
from ..training import TrainingFields

POLICIES = ("time-adaptive", "strict-only", "uniform", "dp-fedavg", "none")
RENAMED = {"rounds": "num-server-rounds"}


def key_of(field: str) -> str:
    """The config key of an AppConfig field."""
    return RENAMED.get(field, field.replace("_", "-"))


def _floats(key: str, value: object) -> tuple[float, ...]:
    if not isinstance(value, str):
        raise TypeError(f"{key!r} must be comma-separated numbers, got {value!r}")
    items = [v for v in value.replace(" ", "").split(",") if v]
    try:
        return tuple(float(v) for v in items)
    except ValueError:
        raise ValueError(
            f"{key!r} must be comma-separated numbers, got {value!r}"
        ) from None


@dataclass(frozen=True)
class AppConfig(TrainingFields, TaskFields):
    """Run configuration of the Flower app (keys hyphenated in ``pyproject.toml``).

    Parameters
    ----------
    policy : {"time-adaptive", "strict-only", "uniform", "dp-fedavg", "none"}
        Spending schedule ("uniform" is IDP-FedAvg, "dp-fedavg" holds everyone to
        the strictest budget, "none" trains without DP).
    dp_wrapper : bool
        Wrap the strategy in Flower's server-side fixed-clipping DP (needs
        ``policy = "none"``); sigma is solved for the strictest budget at client
        level.
    n_clients : int
        Partitions of the simulation (the deployment engine takes the number of
        connected SuperNodes).
    Other fields: the task (:class:`federated.tasks.TaskFields`) and the training
    (:class:`federated.training.TrainingFields`), as in the harness game.
    """

    n_clients: int = 2
    rounds: int = 10
    sigma: float = 1.0
    policy: str = "time-adaptive"
    save_fraction: float = 0.5
    save_ratio: float = 0.7
    dp_wrapper: bool = False
    clipping_norm: float = 1.0
    seed: int = 0
    min_nodes: int = 2
    timeout: float = 600.0
    result_path: str = ""

    def __post_init__(self) -> None:
        k = key_of
        self.check_task_fields(k, min_clients=1)
        self.check_training_fields(k)
        check_choice(k("policy"), self.policy, POLICIES)
        check_int(k("min_nodes"), self.min_nodes, 1)
        check_int(k("seed"), self.seed, 0)
        for name in ("sigma", "clipping_norm", "timeout"):
            check_real(k(name), getattr(self, name), 0.0, open_low=True)
        check_saving(k, self.save_fraction, self.save_ratio)
        if self.dp_wrapper and self.policy != "none":
            raise ValueError(
                "'dp-wrapper' adds Flower's central DP; it needs policy='none', "
                f"got policy={self.policy!r}"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> AppConfig:
        """Build from a run config, checking every value's type.

        Keys are the hyphenated config keys (``num-server-rounds``) or the field
        names (``rounds``, ``n_clients``, as in benchmark specs).

        Raises
        ------
        ValueError
            For an unknown key or a value out of range, naming the key.
        TypeError
            For a value of the wrong type (``2.7`` for an int, ``"yes"`` for a
            bool), naming the key.
        """
        fields = {key_of(f.name): f for f in dataclasses.fields(cls)}
        names = {f.name: key_of(f.name) for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for given, value in values.items():
            key = names.get(given, given)
            if key not in fields:
                raise ValueError(
                    f"unknown app config key {key!r}; known: {sorted(fields)}"
                )
            field = fields[key]
            default = field.default
            if isinstance(default, tuple):
                kwargs[field.name] = _floats(key, value)
                continue
            kind = type(default)
            ok = (
                isinstance(value, bool)
                if kind is bool
                else isinstance(value, kind) and not isinstance(value, bool)
            )
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                raise TypeError(f"{key!r} must be {kind.__name__}, got {value!r}")
            kwargs[field.name] = value
        return cls(**kwargs)

    def record(self) -> dict[str, Any]:
        """The config as run-config values (lists as comma-separated strings)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = ",".join(repr(v) for v in value)
            out[key_of(f.name)] = value
        return out

    def client_privacy(self, partition: int, partitions: int) -> ClientPrivacy | None:
        """Partition ``partition``'s agreement from the run config (``None``: no DP).

        The simulation's stand-in for a node's own configuration: the budget of the
        partition's privacy group (every client at the strictest budget under
        ``dp-fedavg``); under ``strict-only`` only the strictest clients save.
        """
        if self.policy == "none":
            return None
        check_int("partition-id", partition, 0, partitions - 1)
        budgets, _ = assign_groups(partitions, self.budgets, self.group_fractions)
        budget = budgets[partition]
        spending = "time-adaptive"
        if self.policy == "dp-fedavg":
            budget, spending = min(budgets), "uniform"
        elif self.policy == "uniform" or (
            self.policy == "strict-only" and budget > min(budgets)
        ):
            spending = "uniform"
        return ClientPrivacy(
            epsilon=budget,
            delta=self.delta,
            rounds=self.rounds,
            steps=self.local_steps,
            sigma=self.sigma,
            spending=spending,
            save_fraction=self.save_fraction,
            save_ratio=self.save_ratio,
        )
