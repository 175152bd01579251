r"""The public schedule of client-aided requests, derived and enforced by the client.

Without bootstrapping the server must ask the key owner to refresh values (decrypt and
re-encrypt) and to roll K and V; in fine-tuning also to unroll the key and value
gradients. Which requests one inference (or one fine-tuning step) needs is a function of
public things only: the architecture (the sequence of stages of
:func:`crypto.program.heformer.forward` or :func:`crypto.program.backprop.forward` and
:func:`~crypto.program.backprop.backward`, each consuming a known number of levels) and
the CKKS chain (how many levels fit between refreshes). The program has no branch on a
value, so the client derives the schedule itself by running that same program on dummy
values in float64 with a recording key owner: the ``k``-th request is a :class:`Step`
(kind, stage, the level of each ciphertext, the copies of a roll).

The client then answers a server request only if it is the next step of the
schedule, carries exactly that many whole ciphertexts under its key, of the
agreed slot count, at least as deep as the agreed level (at most
``levels + 1 - level`` data primes), two polynomials, the agreed scale, all
checked *before* anything is decrypted (:func:`crypto.protocol.session.admit`). A
non-interactive session has an empty schedule: it answers nothing. Decrypted
values are clipped to a public bound before re-encoding
(:func:`crypto.protocol.session.clip`), so every answer succeeds and takes the same path
whatever the plaintext: SEAL refuses to encode coefficients above
:math:`2^{\log Q_{data}-2}`, which a server could otherwise reach with additions
alone (:math:`2^k(c-a)`) and turn into a one-bit reaction oracle on ``c > a``.

The bound of each ciphertext of a step is the chain's encoding-safe magnitude
:func:`safe_bound` unless the schedule is calibrated (:func:`calibrate`): then it is
``margin`` times the largest magnitude seen at that point of the network on public
calibration inputs; :func:`check_batch` (raising) and :func:`exceeds` (the
client's advisory verdict) compare a batch against it, so the clip changes
nothing in an honest run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from defenses.arrays import FloatArray
from defenses.checks import check_real

from ..he.ckks import CKKSParams
from ..he.evaluator import Evaluator, NumpyBackend, Value
from ..he.packing import pack, roll_tokens

if TYPE_CHECKING:
    from ..models.heformer import HEFormer

KINDS = ("refresh", "roll", "unroll")
ANSWERS = {"refresh": "refreshed", "roll": "rolled", "unroll": "unrolled"}
SAFETY_BITS = 16
"""Bits kept below SEAL's encoding limit by :func:`safe_bound`."""


def safe_bound(params: CKKSParams) -> float:
    r"""The largest slot magnitude a fresh encryption under ``params`` encodes safely.

    A slot vector of sup-norm :math:`B` encodes to coefficients of at most
    :math:`B\Delta`; SEAL refuses coefficients above :math:`2^{\log Q_{data}-2}`
    (:math:`Q_{data}` all primes but the special one), so
    :math:`B = 2^{\log Q_{data} - 2 - \log\Delta - 16}` leaves 16 bits of room.
    """
    data = params.log_q - params.coeff_mod_bit_sizes[-1]
    return float(2.0 ** (data - 2 - params.scale_bits - SAFETY_BITS))


@dataclass(frozen=True)
class Step:
    """One request the server may make: kind, stage, its ciphertexts' levels.

    Parameters
    ----------
    kind : {"refresh", "roll", "unroll"}
        Refresh answers each ciphertext; roll answers ``copies`` rolled copies of
        each; unroll takes ``copies`` shifted groups and answers one summed group.
    stage : str
        The stage of the network that asks (for error messages and the docs).
    levels : tuple of int
        The multiplicative level of each ciphertext the request carries.
    sizes : tuple of int
        The slot count of each ciphertext.
    bounds : tuple of float
        The clip bound of each ciphertext's decrypted slots.
    copies : int
        Roll copies or unroll shifts (1 for a refresh).
    """

    kind: str
    stage: str
    levels: tuple[int, ...]
    sizes: tuple[int, ...]
    bounds: tuple[float, ...]
    copies: int = 1

    def __post_init__(self) -> None:
        if self.kind not in (*KINDS, "logits", "weights"):
            raise ValueError(f"Step.kind must be one of {KINDS}, got {self.kind!r}")
        if not len(self.levels) == len(self.sizes) == len(self.bounds):
            raise ValueError("Step.levels, sizes and bounds must have one entry each")
        if self.kind == "unroll" and len(self.levels) % self.copies:
            raise ValueError("Step: an unroll carries copies x m ciphertexts")

    @property
    def answers(self) -> int:
        """Ciphertexts in the client's answer."""
        m = len(self.levels)
        if self.kind == "roll":
            return self.copies * m
        if self.kind == "unroll":
            return m // self.copies
        return m


@dataclass(frozen=True)
class Schedule:
    """Every request of one session, in order, and the final reply's shape.

    ``reply`` describes the ``logits`` (inference) or ``weights`` (fine-tuning)
    message: its ciphertexts' levels and sizes, checked before decryption.
    """

    steps: tuple[Step, ...]
    reply: Step
    params: CKKSParams
    calibrated: bool = False

    @property
    def requests(self) -> int:
        """Round trips the server may ask for."""
        return len(self.steps)

    def primes(self, level: int) -> int:
        """Data primes left in a ciphertext at ``level``."""
        return self.params.levels + 1 - level


# --- derivation -------------------------------------------------------------------


class Recorder:
    """A key owner that answers in float64 and records each request as a Step.

    ``values[k]`` holds the plaintexts of the ``k``-th request (for calibration).
    """

    def __init__(self, n_tokens: int, bound: float, size: Callable[[Any], int]):
        self.n = n_tokens
        self.bound = bound
        self.size = size
        self.steps: list[Step] = []
        self.values: list[list[FloatArray]] = []
        self.ev: Evaluator | None = None

    def _record(
        self, kind: str, stage: str, vals: Sequence[Value], copies: int
    ) -> None:
        self.steps.append(
            Step(
                kind,
                stage,
                tuple(v.level for v in vals),
                tuple(self.size(v.handle) for v in vals),
                (self.bound,) * len(vals),
                copies,
            )
        )
        self.values.append([np.asarray(v.handle, dtype=np.float64) for v in vals])

    def refresh(self, values: list[Value]) -> list[Value]:
        """Record a refresh at the evaluator's current stage; answer level 0."""
        stage = self.ev.stage if self.ev is not None else "refresh"
        self._record("refresh", stage, values, 1)
        return [Value(np.array(v.handle, dtype=np.float64)) for v in values]

    def roll(self, values: list[Value], copies: int) -> list[list[Value]]:
        """Record a roll; answer the rolled copies."""
        self._record("roll", "roll K and V", values, copies)
        return [
            [Value(roll_tokens(np.asarray(v.handle), self.n, s)) for v in values]
            for s in range(copies)
        ]

    def unroll(self, shifted: list[list[Value]]) -> list[Value]:
        """Record an unroll; answer the rolled-back sums."""
        flat = [v for row in shifted for v in row]
        self._record("unroll", "unroll K and V gradients", flat, len(shifted))
        plain = [[np.asarray(v.handle) for v in row] for row in shifted]
        return [
            Value(sum(roll_tokens(p[i], self.n, -s) for s, p in enumerate(plain)))
            for i in range(len(plain[0]))
        ]


def _size(handle: Any) -> int:
    return int(np.asarray(handle).size)


def _trace_inference(
    model: HEFormer,
    params: CKKSParams,
    interactive: bool,
    z: FloatArray,
    lora: dict[str, FloatArray],
) -> tuple[Recorder, list[Value]]:
    """Run the program of :func:`crypto.program.heformer.forward` with a recorder."""
    from ..he.packing import unit
    from ..program.heformer import HEWeights, forward

    w = HEWeights.from_model(model)
    n, slots = w.n_tokens, z.shape[0] * w.n_tokens
    rec = Recorder(n, safe_bound(params), _size)
    ev = Evaluator(NumpyBackend(), params.levels, rec.refresh if interactive else None)
    rec.ev = ev
    factors = {name: unit(lambda x: x, M) for name, M in lora.items()}
    packed = [Value(p) for p in pack(z, slots)]
    if interactive:
        logits = forward(ev, w, packed, factors, roll=rec.roll)
    else:
        rolled = [
            [Value(roll_tokens(p.handle, n, s)) for p in packed] for s in range(n)
        ]
        logits = forward(ev, w, packed, factors, rolled_z=rolled)
    return rec, logits


def inference_schedule(
    model: HEFormer, params: CKKSParams, interactive: bool, slots: int
) -> Schedule:
    """The schedule of one encrypted inference, from the architecture and the chain.

    Derived on zeros (one sequence) with zero LoRA factors of the model's shapes:
    neither the values nor the batch change which requests the program makes.
    ``slots`` is the packed vector length every ciphertext carries.
    """
    from ..program.heformer import lora_factors

    c = model.config
    shapes = {name: np.zeros_like(M) for name, M in lora_factors(model).items()}
    rec, logits = _trace_inference(
        model, params, interactive, np.zeros((1, c.n_tokens, c.d)), shapes
    )
    return finished(rec, "logits", "logits", logits, params, slots)


def finished(
    rec: Recorder,
    kind: str,
    stage: str,
    outputs: Sequence[Value],
    params: CKKSParams,
    size: int,
) -> Schedule:
    """The schedule of a recorded run: its requests, then the reply ``outputs``.

    Every ciphertext of a request and of the reply gets the slot count ``size``
    (0: one slot or all, fine-tuning's slot sums); the reply is not clipped.
    """
    steps = tuple(replace(s, sizes=(size,) * len(s.levels)) for s in rec.steps)
    reply = Step(
        kind,
        stage,
        tuple(v.level for v in outputs),
        (size,) * len(outputs),
        (math.inf,) * len(outputs),
    )
    return Schedule(steps, reply, params)


def _trace_values(
    model: HEFormer, params: CKKSParams, X: FloatArray
) -> list[list[FloatArray]]:
    """The plaintexts of each request of an interactive inference on ``X``."""
    import torch

    from ..program.heformer import lora_factors

    with torch.no_grad():
        z = model.embed_tokens(torch.as_tensor(X, dtype=torch.float64)).numpy()
    rec, _ = _trace_inference(model, params, True, z, lora_factors(model))
    return rec.values


def calibrate(
    schedule: Schedule, model: HEFormer, X: FloatArray, margin: float = 2.0
) -> Schedule:
    r"""Tighten each step's clip bounds to ``margin`` x the magnitudes seen on ``X``.

    ``X`` should be public calibration sequences (the pretraining data). The bound
    of ciphertext ``j`` of step ``k`` is :math:`\max(m \max|x_{kj}|, 1)` over the
    slots of ``X``'s trace, capped at :func:`safe_bound`.
    """
    margin = check_real("margin", margin, 1.0)
    if not schedule.steps:
        return replace(schedule, calibrated=True)
    traced = _trace_values(model, schedule.params, np.asarray(X, dtype=np.float64))
    if len(traced) != len(schedule.steps):
        raise ValueError("calibrate: the schedule is not the interactive inference's")
    cap = safe_bound(schedule.params)
    steps = tuple(
        replace(
            step,
            bounds=tuple(
                min(max(margin * float(np.max(np.abs(v))), 1.0), cap) for v in vals
            ),
        )
        for step, vals in zip(schedule.steps, traced, strict=True)
    )
    return replace(schedule, steps=steps, calibrated=True)


def _excess(
    schedule: Schedule, model: HEFormer, X: FloatArray
) -> list[tuple[Step, int, float, float]]:
    """Every (step, ciphertext, max |x|, bound) of ``X``'s trace above its bound.

    The whole trace is computed and compared, whatever the values (no early exit).
    """
    if not schedule.calibrated or not schedule.steps:
        return []
    traced = _trace_values(model, schedule.params, X)
    out = []
    for step, vals in zip(schedule.steps, traced, strict=True):
        for j, (v, bound) in enumerate(zip(vals, step.bounds, strict=True)):
            with np.errstate(invalid="ignore"):
                top = float(np.max(np.abs(v)))
            if not top <= bound:  # NaN counts as above
                out.append((step, j, top, bound))
    return out


def exceeds(schedule: Schedule, model: HEFormer, X: FloatArray) -> bool:
    """Whether ``X``'s honest values would be clipped (advisory; never raises).

    The client's session path uses this verdict only locally: with a model a
    server's update touched, a refusal here would be a channel.
    """
    return bool(_excess(schedule, model, X))


def check_batch(schedule: Schedule, model: HEFormer, X: FloatArray) -> None:
    """Refuse (``RangeError``) a batch whose honest values would be clipped.

    For a calibrated schedule: every value the server will ask the client to
    refresh or roll must lie within that point's public bound. A check for the
    caller's own use; the client's sessions use :func:`exceeds` (advisory).
    """
    from ..he.approx import RangeError

    for step, j, top, bound in _excess(schedule, model, X)[:1]:
        raise RangeError(
            f"X leaves the calibrated range of the {step.stage!r} {step.kind} "
            f"(ciphertext {j}: |x| = {top:.4g} > {bound:.4g})"
        )
