"""What every unlearner holds: its state, the audits of it, and its state file.

:class:`StateHolder` keeps the one immutable :class:`~.state.State` of a model and
replaces it only through :meth:`StateHolder._commit`, which writes the state file
first when the model has a ``store``: a failure leaves both as they were. It also
answers the audits' questions (lineage, every held tensor) and saves and loads.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Self

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from defenses.s3t import store
from defenses.s3t.defense import persist
from defenses.s3t.defense.state import (
    NotFittedError,
    State,
    stage_lineage,
    stage_tensors,
)
from defenses.s3t.training import Order, StageKey, StageState


class StateHolder(ABC):
    """The state, audits and persistence shared by every unlearner."""

    shards: int
    slices: int
    orders: tuple[Order, ...]
    backbone: nn.Module
    store: str | None
    _state: State | None

    @abstractmethod
    def _config(self) -> dict[str, Any]:
        """The configuration a state file must match (class, sizes, seed, model)."""

    @property
    def fitted(self) -> bool:
        """Whether :meth:`fit` has run."""
        return self._state is not None

    @property
    def classes_(self) -> npt.NDArray[np.generic]:
        """The sorted class labels seen at :meth:`fit` (the probability columns)."""
        return self._require().classes

    def _require(self) -> State:
        if self._state is None:
            raise NotFittedError(
                f"this {type(self).__name__} is not fitted; call fit first"
            )
        return self._state

    # ------------------------------------------------------------------ audit
    def lineage(self) -> dict[str, frozenset[object]]:
        """Every stored adapter and stage head, and the ids it was trained on.

        Keys are ``shard<s>/prefix<p>/adapter/<layer>`` and
        ``shard<s>/prefix<p>/head``; ``backbone/buffers`` appears when the model has
        shared state updated by training (the leak the audit must catch).
        """
        return stage_lineage(self._require())

    def active_state(self) -> dict[str, torch.Tensor]:
        """Every tensor the model holds: backbone, stored adapters and heads."""
        backbone = {f"backbone/{k}": v for k, v in self.backbone.state_dict().items()}
        return {**backbone, **stage_tensors(self._require())}

    def stages(self) -> Mapping[StageKey, StageState]:
        """The stored stages by (shard, prefix) (read-only)."""
        return MappingProxyType(dict(self._require().stages))

    def training_seconds(self) -> tuple[float, ...]:
        """Wall time spent training each shard's stored stages."""
        per = [0.0] * self.shards
        for (s, _), stage in self._require().stages.items():
            per[s] += stage.seconds
        return tuple(per)

    def training_ids(self) -> frozenset[object]:
        """The ids of the surviving fine-tuning data."""
        return frozenset(self._require().data.ids)

    # ------------------------------------------------------------------ persist
    def _commit(self, state: State) -> None:
        if self.store is not None:
            store.write_atomic(self.store, store.encode(self._payload(state)))
        self._state = state

    def _payload(self, state: State) -> dict[str, Any]:
        return persist.encode(state, self._config())

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the state atomically to ``path``."""
        store.write_atomic(path, store.encode(self._payload(self._require())))

    def load(self, path: str | os.PathLike[str]) -> Self:
        """Replace the state by the one saved at ``path``.

        Raises
        ------
        StateFileError
            The file is corrupted or was saved by a model with another class,
            configuration or backbone. The model is left as it was.
        """
        self._state = persist.read(
            path, self._config(), self.shards, self.slices, len(self.orders)
        )
        return self
