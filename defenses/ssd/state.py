"""A fitted :class:`~defenses.ssd.defense.StealthyShield` as a few arrays, and back.

What makes the defense (the prototypes, the settings, the key and position of the
random stream) fits in three arrays, so it can live in a torch ``state_dict``
(:class:`~defenses.ssd.torch.ShieldedModule`'s buffers) or a ``numpy.savez`` file
and answer exactly as before once restored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.ssd.seeding import SEEDINGS
from defenses.ssd.waterfill import check_probabilities

STATE_KEYS = ("prototypes", "settings", "stream")


def shield_state(shield: Any) -> dict[str, npt.NDArray[Any]]:
    """The fitted defense as arrays: prototypes, settings and the random stream.

    ``settings`` is ``[epsilon, temperature, seeding, hash_resolution,
    n_threads]`` (NaN for None; seeding as its index in :data:`SEEDINGS`),
    ``stream`` the key and the counter (uint64, stored as int64 bits).
    """

    def number(value: Any) -> float:
        return math.nan if value is None else float(value)

    settings = [shield.epsilon, shield.temperature, SEEDINGS.index(shield.seeding)]
    settings += [shield.hash_resolution, shield.n_threads]
    if shield.prototypes_ is None:
        raise RuntimeError("the shield is not fitted: call fit(val_probs, val_labels)")
    stream = np.array([shield.key_, shield.counter_], dtype=np.uint64)
    return {
        "prototypes": np.array(shield.prototypes_, dtype=np.float64),
        "settings": np.array([number(v) for v in settings]),
        "stream": stream.view(np.int64),
    }


def load_shield_state(shield: Any, state: Mapping[str, npt.ArrayLike]) -> Any:
    """Restore what :func:`shield_state` returned (validated); returns ``shield``."""
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"state: missing {missing}")
    settings = np.asarray(state["settings"], dtype=np.float64)
    prototypes = np.asarray(state["prototypes"], dtype=np.float64)
    stream = np.ascontiguousarray(state["stream"], dtype=np.int64).view(np.uint64)
    if settings.shape != (5,) or stream.shape != (2,):
        raise ValueError("state: settings must have 5 entries and stream 2")
    if settings[2] not in (0.0, 1.0):
        raise ValueError(f"state: seeding index must be 0 or 1, got {settings[2]}")
    if prototypes.ndim != 2 or prototypes.shape[0] != prototypes.shape[1]:
        raise ValueError(f"state: prototypes must be (K, K), got {prototypes.shape}")
    check_probabilities("state prototypes", prototypes, 1e-9)

    def given(value: float) -> float | None:
        return None if math.isnan(value) else float(value)

    threads = given(settings[4])
    shield.set_params(
        epsilon=float(settings[0]),
        temperature=given(settings[1]),
        seeding=SEEDINGS[int(settings[2])],
        hash_resolution=given(settings[3]),
        n_threads=None if threads is None else int(threads),
    )
    shield.prototypes_ = prototypes.copy()
    shield.key_, shield.counter_ = stream[0], stream[1]
    return shield
