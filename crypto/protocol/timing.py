r"""The client's answer times, padded to a public floor (on by default).

SEAL decodes coefficients wider than 128 bits more slowly, and a server chooses
the plaintexts it asks the client to decrypt (:math:`2^k (c - a)` from additions
alone), so the time of an answer could tell it something of a secret. Every
answer, and every decryption of a final reply, is padded to

.. math::

    T = f \cdot u, \qquad u = \tfrac12 (n_{\text{in}} + n_{\text{out}}),

``f`` the floor in seconds per unit (a refresh of one ciphertext is one unit:
one decryption and one encryption) and ``u`` the request's units, public (the
schedule's counts). While an answer's own time stays below ``T`` the server sees
``T``, whatever the plaintext; only an overrun (a loaded machine) shows its
excess.

``answer_floor="auto"`` (the default) measures ``f`` once, from public values:
the client answers its own worst case (:func:`worst_case_floor`: a refresh of
level-0 ciphertexts whose plaintexts sit at the encoding limit, the slowest to
decode) a few times and takes :data:`FLOOR_MARGIN` times the slowest unit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from defenses.checks import check_real

from ..he.ckks import CKKSParams
from .schedule import Step, safe_bound
from .wire import Message

FLOOR_MARGIN = 2.0
"""The automatic floor is this many times the slowest measured unit."""
FLOOR_UNITS = 2
"""Ciphertexts of each measured refresh."""
FLOOR_REPEATS = 3
"""Measured refreshes (each of :data:`FLOOR_UNITS` ciphertexts)."""

Floor = float | str


def check_floor(value: object) -> Floor:
    """``"auto"`` or seconds >= 0, else ValueError naming ``answer_floor``."""
    if value == "auto":
        return "auto"
    return check_real("answer_floor", value, 0.0)


def floor_parameter(params: Mapping[str, Any]) -> Floor:
    """A benchmark's ``answer_floor`` parameter (default ``"auto"``), checked.

    ``"auto"``, the protocol's own default, pads every answer to a measured floor;
    ``0`` answers at once. The padding is sleep: wall seconds and no CPU seconds,
    so a benchmark that measures something else (CPU seconds, accuracy) may leave
    it off and say so.

    Raises
    ------
    ValueError
        Naming ``answer_floor`` and the value, if it is neither.
    """
    value = params.get("answer_floor", "auto")
    try:
        return check_floor(value)
    except ValueError:
        raise ValueError(
            'benchmark parameter answer_floor must be "auto" or seconds >= 0, '
            f"got {value!r}"
        ) from None


def units(step: Step, outputs: int) -> float:
    """A request's public units: (ciphertexts in + ciphertexts out) / 2."""
    return 0.5 * (len(step.levels) + outputs)


def pad(start: float, floor: float, amount: float) -> None:
    """Sleep until ``floor * amount`` seconds have passed since ``start``."""
    rest = floor * amount - (time.perf_counter() - start)
    if rest > 0:
        time.sleep(rest)


def _data_bits(params: CKKSParams) -> int:
    return sum(params.coeff_mod_bit_sizes[:-1])


def worst_case_floor(
    answer: Callable[[Message, Step], Message],
    public: Any,
    key: str,
    params: CKKSParams,
    slots: int,
) -> float:
    """Seconds per unit: :data:`FLOOR_MARGIN` x the slowest unit of the worst case.

    ``answer`` is the client's own answer function and ``public`` its public
    context; the requests are made here from public values only (a constant
    doubled by additions to 4 bits under SEAL's encoding limit, at level 0).
    """
    import tenseal as ts

    step = Step(
        "refresh",
        "timing floor",
        (0,) * FLOOR_UNITS,
        (slots,) * FLOOR_UNITS,
        (safe_bound(params),) * FLOOR_UNITS,
    )
    huge = ts.ckks_vector(public, [0.5] * slots)
    for _ in range(_data_bits(params) - 4 - params.scale_bits):
        huge = huge + huge
    request = Message("refresh", key, (huge.serialize(),) * FLOOR_UNITS)
    slowest = 0.0
    for _ in range(FLOOR_REPEATS):
        start = time.perf_counter()
        answer(request, step)
        slowest = max(slowest, time.perf_counter() - start)
    return FLOOR_MARGIN * slowest / FLOOR_UNITS


def resolve_floor(owner: Any, slots: int) -> float:
    """``owner.answer_floor`` in seconds; ``"auto"`` is measured once, here.

    ``owner`` is a key owner with ``answer``, ``context``, ``key``, ``params``
    and ``answer_floor``; its integer counters (decryptions, clipped slots, ...)
    are left as they were, and the measured answers are not padded.
    """
    if isinstance(owner.answer_floor, float):
        return owner.answer_floor
    saved = {k: v for k, v in vars(owner).items() if type(v) is int}
    owner.answer_floor = 0.0
    try:
        measured = worst_case_floor(
            owner.answer, owner.context, owner.key, owner.params, slots
        )
    finally:
        owner.answer_floor = "auto"
        vars(owner).update(saved)
    owner.answer_floor = measured
    return measured
