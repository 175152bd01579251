"""The kernel a shield's call runs: compiled, or its numpy twin while it compiles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from defenses.arrays import FloatArray
from defenses.ssd.kernels import plain
from defenses.ssd.kernels.background import pick
from defenses.ssd.kernels.shield import shield_rows
from defenses.ssd.kernels.small import SMALL_K, shield_rows_small
from defenses.ssd.waterfill import MAX_NEWTON_STEPS


def shield_kernel(args: tuple[Any, ...]) -> Callable[..., FloatArray]:
    """The row-batched kernel at small K, the row kernel above, or their twin.

    ``args`` are :func:`~.shield.shield_rows`'s, built the same way every call
    (:class:`~defenses.ssd.defense.StealthyShield`): only the rows' dtype and
    alignment change numba's types, so they alone key :func:`~.background.pick`.
    """
    rows = args[0]
    kernel = (
        shield_rows_small
        if rows.shape[1] <= min(SMALL_K, MAX_NEWTON_STEPS)
        else shield_rows
    )
    types = (rows.dtype.str, rows.flags.aligned)
    chosen: Callable[..., FloatArray] = pick(kernel, plain.shield_rows, args, types)
    return chosen
