"""An unlearner's state as a plain payload for :mod:`defenses.s3t.store`, and back.

The payload holds only containers, strings, numbers and tensors (``torch.load``
with ``weights_only=True`` reads it back, so a state file cannot run code): the
configuration it was saved under (class, sizes, orders, training settings, seed,
target layers, head, backbone fingerprint), the classes and the input shape, the
surviving rows, every stored stage with its lineage, the live table and the
tombstones. :func:`decode` refuses a payload whose configuration
differs from the model's, naming every differing field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from defenses.s3t import partition, store
from defenses.s3t.defense.state import Data, State
from defenses.s3t.training import StageKey, StageState

FORMAT = 2


def encode(state: State, config: Mapping[str, Any]) -> dict[str, Any]:
    """The payload of ``state`` saved under ``config``."""
    stages = {}
    for (s, prefix), stage in state.stages.items():
        stages[f"{s}:{','.join(map(str, prefix))}"] = {
            "adapters": {name: list(t) for name, t in stage.adapters.items()},
            "head": dict(stage.head),
            "lineage": sorted(stage.lineage, key=partition.id_token),
            "samples": stage.samples,
            "passes": stage.passes,
            "seconds": stage.seconds,
        }
    data = state.data
    return {
        "format": FORMAT,
        "config": dict(config),
        "X": torch.as_tensor(data.X),
        "y": torch.as_tensor(data.y),
        "ids": list(data.ids),
        "key": torch.as_tensor(data.key.view(np.int64)),
        "stages": stages,
        "live": [list(row) for row in state.live],
        "tombstones": sorted(t.hex() for t in state.tombstones),
        "shared_lineage": sorted(state.shared_lineage, key=partition.id_token),
        "classes": state.classes.tolist(),
        "input_shape": list(state.input_shape),
    }


def _check_config(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
    if diff:
        raise store.StateFileError(
            "the state file does not match this model: "
            + "; ".join(
                f"{k}: saved {saved.get(k)!r}, here {mine.get(k)!r}" for k in diff
            )
        )


def _stage(raw: Mapping[str, Any]) -> StageState:
    return StageState(
        adapters={str(name): (t[0], t[1]) for name, t in raw["adapters"].items()},
        head={str(name): t for name, t in raw["head"].items()},
        lineage=frozenset(raw["lineage"]),
        samples=int(raw["samples"]),
        passes=int(raw["passes"]),
        seconds=float(raw["seconds"]),
    )


def decode(
    payload: Mapping[str, Any],
    config: Mapping[str, Any],
    shards: int,
    slices: int,
    n_orders: int,
) -> State:
    """The state in ``payload``, checked against the model's ``config``.

    Raises
    ------
    StateFileError
        Another format or configuration.
    KeyError, TypeError, ValueError, AttributeError
        A malformed payload (the caller reports it as a :class:`StateFileError`).
    """
    if payload.get("format") != FORMAT:
        raise store.StateFileError(
            f"state format {payload.get('format')!r}, expected {FORMAT}"
        )
    _check_config(payload["config"], config)
    key = payload["key"].numpy().view(np.uint64).copy()
    shard, slc = partition.assign(key, shards, slices)
    data = Data(
        payload["X"].numpy().copy(),
        payload["y"].numpy().copy(),
        list(payload["ids"]),
        key,
        shard,
        slc,
    )
    if not (len(data.ids) == len(data.y) == len(data.X) == len(key)):
        raise ValueError("data arrays of different lengths")
    stages: dict[StageKey, StageState] = {}
    for name, raw in payload["stages"].items():
        s, _, text = name.partition(":")
        stages[(int(s), tuple(int(j) for j in text.split(",")))] = _stage(raw)
    live = tuple(tuple(int(v) for v in row) for row in payload["live"])
    if len(live) != shards or any(len(r) != n_orders for r in live):
        raise ValueError("live prefix table has the wrong shape")
    return State(
        data,
        stages,
        live,
        frozenset(bytes.fromhex(t) for t in payload["tombstones"]),
        frozenset(payload["shared_lineage"]),
        np.asarray(payload["classes"]),
        tuple(int(d) for d in payload["input_shape"]),
    )


def read(
    path: str | os.PathLike[str],
    config: Mapping[str, Any],
    shards: int,
    slices: int,
    n_orders: int,
) -> State:
    """The state saved at ``path``; any malformed content is a StateFileError."""
    payload = store.read(path)
    try:
        return decode(payload, config, shards, slices, n_orders)
    except store.StateFileError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise store.StateFileError(f"{path}: malformed state ({error!r})") from error
