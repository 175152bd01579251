r"""Benchmark ``crypto-finetune-sweep``: the fine-tuning speed-up at the paper's width.

Rho et al. (2025) report 6.94x for LoRA + Gaussian-kernel fine-tuning against full
fine-tuning + softmax at BERT-base width (d = 768), far beyond what one encrypted
step can reach on a laptop. This benchmark

1. times one encrypted SGD step (:func:`crypto.protocol.finetune.encrypted_step`) of
   each arm over a grid of widths and sequence lengths, one after the other in one
   process and under one key per sequence length; the model is fitted on the user
   CPU seconds of this process (``step_cpu_s``: the computation), with the
   system CPU seconds beside them (``step_system_s``: page faults and memory
   mapping, which follow the process's footprint, not the operations), the wall
   seconds (on a shared machine they measure the other processes too) and the
   process's peak resident memory so far (``peak_rss_mb``: widths listed in
   increasing order make it the peak of the widest step yet);
2. counts each arm's operations exactly: :class:`~crypto.he.costmodel.CountModel` is
   fitted on simulated steps of 15 small shapes and checked on larger ones;
3. times each operation in isolation and fits how a real step scales the bare
   operations and how that scale grows with the width
   (:class:`~crypto.he.costmodel.CostModel`; with ``free_units``, an extra cost per
   operation of the named kinds) on the widths below ``held_out``, and
   checks the model on every width from ``held_out`` up (the signed relative error
   :math:`e = (\hat T - T) / T` of each arm at each held-out width);
4. projects each arm's step to :data:`~crypto.he.costmodel.PAPER` (and along a curve of
   widths up to it), in this package's layout and ring, with an interval from the
   held-out errors (:func:`interval`).

Records keep the two apart: measured steps are the arms' own labels (``none`` for
full + softmax), projections ``paper-width <arm>``, the projection along BERT-like
shapes ``curve <arm>`` and the fitted model along the measured shapes ``model
<arm>``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from defenses.checks import int_param
from defenses.cost import peak_rss_mb
from defenses.harness import measurement
from defenses.results import Result

from ..he.costmodel import OPERATIONS, PAPER, CostModel, CountModel, Shape, operations
from ..program.folding import Arm
from ..program.steps import TRAIN_PARAMS, simulated_step
from ..protocol.finetune import KeyOwner, encrypted_step
from ..protocol.timing import floor_parameter
from ..tasks import Sequences, digit_sequences
from .finetune import ARM_NAMES, BASELINE
from .heldout import bounds, interval
from .sweep_units import count_model, pretrained_model, unit_costs

log = logging.getLogger(__name__)

__all__ = ["count_model", "finetune_sweep", "interval", "unit_costs"]

CURVE = (8, 16, 32, 64, 128, 256, 512, 768)


def _tokens(data: Sequences, n: int) -> Sequences:
    """Digits as ``n`` tokens of ``64 / n`` pixels."""
    return Sequences(data.X.reshape(len(data), n, 64 // n), data.y, data.n_classes)


def _list(params: Mapping[str, Any], key: str, default: list[int]) -> list[int]:
    values = params.get(key, default)
    if not isinstance(values, list) or not values:
        raise ValueError(f"benchmark parameter {key} must be a non-empty list")
    return [int_param({key: v}, key, 1) for v in values]


def _arm(name: str) -> Arm:
    trained, attention = name.split("-")
    return Arm(trained, attention)


def _label(name: str) -> str:
    return "none" if name == BASELINE else name


def finetune_sweep(params: Mapping[str, Any], seeds: list[int]) -> Iterable[Result]:
    """Measured steps over widths and lengths, the fitted model, the projection."""
    widths = _list(params, "widths", [2, 3, 4, 5])
    tokens = _list(params, "tokens", [2])
    held_out = int_param(params, "held_out", max(widths))
    growth = params.get("growth", False)
    if not isinstance(growth, bool):
        raise ValueError(
            f"benchmark parameter growth must be true or false, got {growth!r}"
        )
    free = params.get("free_units", [])
    if not isinstance(free, list) or any(k not in OPERATIONS for k in free):
        raise ValueError(
            f"benchmark parameter free_units must be a list of {OPERATIONS}, "
            f"got {free!r}"
        )
    batch = int_param(params, "batch", 4)
    ratio = int_param(params, "ffn_ratio", 1)
    epochs = int_param(params, "pretrain_epochs", 1)
    lr = float(params.get("lr", 0.5))
    arms = list(params.get("arms", list(ARM_NAMES)))
    floor = floor_parameter(params)
    if (
        len(set(widths)) < 4
        or held_out not in widths
        or len({d for d in widths if d < held_out}) < 3
    ):
        raise ValueError(
            "benchmark parameters: widths needs at least four distinct values and "
            "held_out one of them with at least three narrower (fitted) widths, got "
            f"widths={widths}, held_out={held_out}"
        )
    if not arms or any(a not in ARM_NAMES for a in arms) or BASELINE not in arms:
        raise ValueError(
            f"benchmark parameter arms must be from {ARM_NAMES} and include "
            f"{BASELINE}, got {arms}"
        )
    bad = [n for n in tokens if 64 % n]
    if bad:
        raise ValueError(f"benchmark parameter tokens: {bad} do not divide 64 pixels")
    digits = digit_sequences()
    for seed in seeds:
        order = np.random.default_rng(seed).permutation(len(digits))
        counts = {name: count_model(_arm(name), seed) for name in arms}
        points = []
        recorded: dict[tuple[str, Shape], dict[str, float]] = {}
        unit: dict[str, float] = {}
        for n in tokens:
            data = _tokens(digits.subset(order[:300]), n)
            owner = KeyOwner(TRAIN_PARAMS, n)
            unit = unit or unit_costs(owner, batch * n)
            for d in widths:
                shape = Shape(d, ratio * d, n, 1, batch)
                model = pretrained_model(data, shape, epochs, seed)
                X, y = data.X[:batch], data.y[:batch]
                for name in arms:
                    got = encrypted_step(
                        model, X, y, lr, _arm(name), owner=owner, answer_floor=floor
                    )
                    want = simulated_step(model, X, y, lr, _arm(name))
                    diff = max(
                        float(np.max(np.abs(got.weights[k] - want.weights[k])))
                        for k in got.weights
                    )
                    user = got.cpu_seconds - got.system_seconds
                    points.append((name, shape, user, got.counts, diff))
                    recorded[name, shape] = {
                        "step_system_s": got.system_seconds,
                        "step_s": got.seconds,
                        "peak_rss_mb": peak_rss_mb(),
                    }
                    log.info(
                        "%s d=%d tokens=%d: %.2f user CPU s + %.2f system "
                        "(%.2f s wall), counts %s",
                        name, d, n, user, got.system_seconds, got.seconds, got.counts,
                    )  # fmt: skip
        cost, held = _fitted(unit, points, held_out, growth, free)
        # diagnostics: the same fit with the growth term toggled, and the flat model
        other_error = max(
            map(abs, _fitted(unit, points, held_out, not growth, free)[1].values())
        )
        flat_error = max(
            map(abs, _fitted(unit, points, held_out, False, [])[1].values())
        )
        base = {(s.d, s.n_tokens): t for name, s, t, _, _ in points if name == BASELINE}
        for name, shape, seconds, step_counts, diff in points:
            ops = operations(step_counts, shape)
            predicted = cost.predict(ops, shape.d)
            yield measurement(
                "crypto-finetune-sweep",
                _label(name),
                seed,
                utility={
                    "speedup_vs_full_softmax": base[shape.d, shape.n_tokens] / seconds,
                    "step_diff": diff,
                    "model_error": abs(predicted - seconds) / seconds,
                },
                cost={
                    "step_cpu_s": seconds,
                    **recorded[name, shape],
                    "model_step_cpu_s": predicted,
                    **ops,
                    "rescalings": ops["ct_ct_mul"] + ops["ct_pt_mul"],
                    "refresh_rounds": float(step_counts.get("refresh_rounds", 0)),
                },
                params={
                    "variant": name,
                    "d": shape.d,
                    "ffn": shape.ffn,
                    "tokens": shape.n_tokens,
                    "batch": batch,
                    "answer_floor": floor,
                    "role": "held-out" if shape.d >= held_out else "fit",
                },
            )
        family = (ratio, max(tokens), batch)
        yield from _projection(
            arms, counts, cost, points, held, held_out, family, seed,
            (other_error, flat_error),
        )  # fmt: skip


Point = tuple[str, Shape, float, dict[str, int], float]
"""A measured step: arm, shape, CPU seconds, counts, largest weight difference."""


def _fitted(
    unit: Mapping[str, float],
    points: Sequence[Point],
    held_out: int,
    growth: bool,
    free: Sequence[str],
) -> tuple[CostModel, dict[tuple[str, Shape], float]]:
    """The cost model fitted below ``held_out`` and its signed errors from there up."""
    fit = [p for p in points if p[1].d < held_out]
    cost = CostModel.fit(
        unit,
        [operations(p[3], p[1]) for p in fit],
        [p[2] for p in fit],
        [p[1].d for p in fit] if growth else None,
        free,
    )
    held = {
        (name, s): cost.predict(operations(c, s), s.d) / t - 1
        for name, s, t, c, _ in points
        if s.d >= held_out
    }
    return cost, held


def _finite(key: str, value: float) -> dict[str, float]:
    """``{key: value}``, or nothing where ``value`` is infinite (an unbounded end)."""
    return {key: value} if math.isfinite(value) else {}


def _projection(
    arms: list[str],
    counts: Mapping[str, tuple[CountModel, float]],
    cost: CostModel,
    points: list[Point],
    held: Mapping[tuple[str, Shape], float],
    held_out: int,
    family: tuple[int, int, int],
    seed: int,
    diagnostics: tuple[float, float] | None = None,
) -> Iterable[Result]:
    widest = max(s.d for _, s, _, _, _ in points)
    longest = max(s.n_tokens for _, s, _, _, _ in points if s.d == widest)
    measured = {
        name: t
        for name, s, t, _, _ in points
        if s.d == widest and s.n_tokens == longest
    }
    held_widths = sorted({s.d for _, s in held})
    by_width = {
        d: {name: [e for (n, s), e in held.items() if s.d == d and n == name]
            for name in arms}
        for d in held_widths
    }  # fmt: skip

    def speedup_errors(name: str) -> dict[int, list[float]]:
        # predicted / measured speed-up - 1 = (1 + e_base) / (1 + e_arm) - 1
        return {
            d: [
                (1.0 + held[BASELINE, s]) / (1.0 + e) - 1.0
                for (n, s), e in held.items()
                if n == name and s.d == d
            ]
            for d in held_widths
        }

    def projected(name: str, shape: Shape) -> tuple[float, dict[str, float]]:
        ops = operations(counts[name][0].predict(shape), shape)
        return cost.predict(ops, shape.d), ops

    paper_base, _ = projected(BASELINE, PAPER)
    for name in arms:
        seconds, ops = projected(name, PAPER)
        speedup = paper_base / seconds
        time_errors = interval({d: by_width[d][name] for d in held_widths}, PAPER.d)
        ratio_errors = interval(speedup_errors(name), PAPER.d)
        t_low, t_high = bounds(seconds, time_errors)
        s_low, s_high = bounds(speedup, ratio_errors)
        yield measurement(
            "crypto-finetune-sweep",
            f"paper-width {name}",
            seed,
            utility={
                "projected_speedup": speedup,
                "projected_speedup_low": s_low,
                # the interval's size E; without a finite upper end where E >= 1
                "projected_speedup_interval_error": ratio_errors[1],
                **_finite("projected_speedup_high", s_high),
                "measured_speedup": measured[BASELINE] / measured[name],
                "heldout_error": max(
                    abs(e) for es in by_width[widest].values() for e in es
                ),
                "heldout_error_all": max(abs(e) for e in held.values()),
                **(
                    {}
                    if diagnostics is None
                    else {
                        "heldout_error_other_model": diagnostics[0],
                        "heldout_error_flat_model": diagnostics[1],
                    }
                ),
                **{
                    f"heldout_error_d{d}": max(
                        abs(e) for es in by_width[d].values() for e in es
                    )
                    for d in held_widths
                },
                **{
                    f"heldout_signed_error_d{d}": by_width[d][name][-1]
                    for d in held_widths
                },
                "count_error": counts[name][1],
            },
            cost={
                "projected_step_cpu_s": seconds,
                "projected_step_cpu_s_low": t_low,
                "projected_step_cpu_s_interval_error": time_errors[1],
                **_finite("projected_step_cpu_s_high", t_high),
                **ops,
                **{f"unit_{k}_ms": 1000 * v for k, v in cost.unit_s.items()},
                "model_scale": cost.scale,
                "model_growth": cost.growth,
                "model_overhead_s": cost.overhead_s,
                **{f"model_extra_{k}_ms": 1000 * v for k, v in cost.extra_s.items()},
            },
            params={
                "variant": name,
                "d": PAPER.d,
                "ffn": PAPER.ffn,
                "tokens": PAPER.n_tokens,
                "heads": PAPER.heads,
                "batch": PAPER.batch,
                "measured_up_to_d": widest,
                "held_out_d": held_out,
                "role": "projected",
            },
        )
    ratio, n, batch = family
    widths = sorted({min(s.d for _, s, _, _, _ in points), *CURVE})
    curves = (
        (
            "curve",
            [
                Shape(d, 4 * d, PAPER.n_tokens, max(1, d // 64), PAPER.batch)
                for d in CURVE
            ],
        ),
        ("model", [Shape(d, ratio * d, n, 1, batch) for d in widths]),
    )
    for role, shapes in curves:
        for shape in shapes:
            for name in arms:
                seconds, _ = projected(name, shape)
                yield measurement(
                    "crypto-finetune-sweep",
                    f"{role} {name}",
                    seed,
                    cost={"projected_step_cpu_s": seconds},
                    params={"variant": name, "d": shape.d, "role": role},
                )
