"""Baselines with the S3T API: SISA and full retraining.

Both run on the same engine (:class:`defenses.s3t.defense.Unlearner`), model,
target layers and LoRA adapters as S3T, so that differences come from the training
schedule alone; they take any ``nn.Module`` with ``target_modules`` and ``head`` as
:class:`~defenses.s3t.defense.S3T` does.
"""

from __future__ import annotations

import os
from typing import ClassVar

from torch import nn

from defenses.checks import check_int
from defenses.s3t.adapters import Targets
from defenses.s3t.defense import Unlearner
from defenses.s3t.parallel import Executor
from defenses.s3t.training import Mode


class SISA(Unlearner):
    """SISA (Bourtoule et al., IEEE S&P 2021) with LoRA on the same backbone.

    One order per shard; every adapter group and the head train at every stage on
    the cumulative slices, with a checkpoint per slice. A deletion falls back to the
    checkpoint before the hit slice; :meth:`retrain` redoes the later stages.
    Parameters as for :class:`S3T`.
    """

    mode: ClassVar[Mode] = "all"

    def __init__(
        self,
        model: nn.Module,
        shards: int = 3,
        slices: int = 3,
        rank: int = 4,
        *,
        target_modules: Targets | None = None,
        head: str | None = None,
        epochs: int = 20,
        batch_size: int = 64,
        lr: float = 3e-3,
        seed: int = 0,
        executor: Executor = "serial",
        n_jobs: int = 1,
        ray_address: str | None = None,
        store: str | os.PathLike[str] | None = None,
        allow_shared_state: bool = False,
    ) -> None:
        super().__init__(
            model,
            target_modules=target_modules,
            head=head,
            shards=shards,
            slices=slices,
            orders=[tuple(range(check_int("slices", slices, minimum=1)))],
            rank=rank,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            executor=executor,
            n_jobs=n_jobs,
            ray_address=ray_address,
            store_path=store,
            allow_shared_state=allow_shared_state,
        )


class FullRetrain(SISA):
    """One model on all the data (every adapter group): any deletion retrains it."""

    def __init__(
        self,
        model: nn.Module,
        rank: int = 4,
        *,
        target_modules: Targets | None = None,
        head: str | None = None,
        epochs: int = 20,
        batch_size: int = 64,
        lr: float = 3e-3,
        seed: int = 0,
        store: str | os.PathLike[str] | None = None,
        allow_shared_state: bool = False,
    ) -> None:
        super().__init__(
            model,
            shards=1,
            slices=1,
            rank=rank,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            store=store,
            allow_shared_state=allow_shared_state,
            target_modules=target_modules,
            head=head,
        )
