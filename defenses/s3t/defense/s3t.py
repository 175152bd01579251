"""The S3T estimator: the engine with ``B`` selected slice orders per shard."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt
from torch import nn

from defenses.checks import as_numbers, check_int
from defenses.s3t.adapters import Targets
from defenses.s3t.defense.unlearner import Unlearner
from defenses.s3t.parallel import Executor
from defenses.s3t.sequences import bms_orders, cyclic_orders
from defenses.s3t.training import Mode

Selection = Literal["cyclic", "bms"]
MAX_SLICES = 1024


def _prior(slice_prior: Sequence[float] | None, slices: int) -> npt.NDArray[np.float64]:
    """The deletion probabilities of the slices (uniform if None), normalised."""
    if slice_prior is None:
        return np.full(slices, 1.0 / slices)
    prior = as_numbers("slice_prior", slice_prior)
    if prior.shape != (slices,):
        raise ValueError(
            f"slice_prior must have one value per slice ({slices}), got shape "
            f"{prior.shape}"
        )
    if not np.all(np.isfinite(prior)) or np.any(prior < 0) or prior.sum() <= 0:
        raise ValueError(
            f"slice_prior must be finite, >= 0 and not all zero, got {prior}"
        )
    normalised: npt.NDArray[np.float64] = prior / prior.sum()
    return normalised


class S3T(Unlearner):
    """Sequence-aware sharded sliced training (Chowdhury et al., ICLR 2025).

    Parameters
    ----------
    model : nn.Module
        The user's pretrained model (copied and frozen; put it in eval mode). Its
        output for a batch are class logits of shape ``(n, K)`` (a tensor, an
        object with ``.logits`` such as a transformers output, or a tuple starting
        with them), ``K`` the number of classes in ``y``.
    shards, slices : int
        ``m`` shards of ``L`` slices; ``L`` at most the number of target layers.
    sequences : int or None
        Budget ``B`` of slice orders per shard (``L`` if None).
    rank : int
        LoRA rank.
    target_modules : list of str, str or callable
        The layers that get the sliced adapters, as in peft's
        ``LoraConfig(target_modules=...)``: names (a layer matches when its name
        equals an entry or ends with ``"." + entry``), a regular expression (full
        match) or a predicate ``(name, module) -> bool``; ``nn.Linear`` or
        ``nn.Conv2d`` layers. They are split into ``L`` groups counted from the top
        (registration order). Required except for the built-in
        :class:`~defenses.s3t.backbone.ResidualMLP` (both linear maps of every
        block).
    head : str or None
        The module (e.g. ``"classifier"``) trained in full at every stage and stored
        with its prefix (peft's ``modules_to_save``). None: ``"head"`` for the
        built-in ResidualMLP, no head (adapters only) for other models.
    selection : {"cyclic", "bms"}
        Order selection: cyclic rotation, or bipartite matching on ``slice_prior``.
    slice_prior : sequence of float or None
        Deletion probability of each slice index (BMS only; uniform if None).
    epochs, batch_size, lr : int, int, float
        Adam settings of every stage.
    seed : int
        Seeds the partition and every stage.
    executor : {"serial", "process", "ray"}
        Where shards train (in parallel except "serial"); ``n_jobs`` workers;
        ``ray_address`` of a Ray cluster (local Ray if None).
    store : path or None
        If given, every fit, deletion and retraining is saved there atomically.
    allow_shared_state : bool
        Accept a model whose buffers training updates (negative control only).
    """

    mode: ClassVar[Mode] = "slice"

    def __init__(
        self,
        model: nn.Module,
        shards: int = 3,
        slices: int = 3,
        sequences: int | None = None,
        rank: int = 4,
        selection: Selection = "cyclic",
        *,
        target_modules: Targets | None = None,
        head: str | None = None,
        slice_prior: Sequence[float] | None = None,
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
        slices = check_int("slices", slices, 1, MAX_SLICES)
        budget = slices if sequences is None else sequences
        budget = check_int("sequences", budget, minimum=1)
        if selection == "cyclic":
            if slice_prior is not None:
                raise ValueError("slice_prior is used by selection='bms' only")
            orders = cyclic_orders(slices, budget)
        elif selection == "bms":
            orders = bms_orders(_prior(slice_prior, slices), budget)
        else:
            raise ValueError(f"selection must be 'cyclic' or 'bms', got {selection!r}")
        self.sequences, self.selection = budget, selection
        super().__init__(
            model,
            target_modules=target_modules,
            head=head,
            shards=shards,
            slices=slices,
            orders=orders,
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
