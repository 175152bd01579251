from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from defense_suite.crypto.benchmark.sweep import (
    count_model,
    finetune_sweep,
    interval,
    unit_costs,
)
from defense_suite.crypto.benchmark.sweep_units import COUNT_CHECK, COUNT_DESIGN
from defense_suite.crypto.figures import figures
from defense_suite.crypto.he.costmodel import (
    MONOMIALS,
    OPERATIONS,
    PAPER,
    CostModel,
    CountModel,
    Shape,
    operations,
)
from defense_suite.crypto.he.evaluator import Evaluator, NumpyBackend, Value
from defense_suite.crypto.program.folding import Arm
from defense_suite.crypto.program.steps import TRAIN_PARAMS
from defense_suite.crypto.protocol.finetune import KeyOwner
from defenses.harness import measurement


def test_shape_is_validated() -> None:
    with pytest.raises(ValueError, match=r"Shape\.d"):
        Shape(0, 4, 2)
    with pytest.raises(ValueError, match=r"multiple of Shape\.heads"):
        Shape(6, 4, 2, heads=4)
    assert Shape(np.int64(4), 8, 2).d == 4
    assert PAPER.slots == 16 * 128
    assert len(Shape(2, 2, 2).monomials()) == len(MONOMIALS)


def test_rotations_are_log2_of_the_packed_slots_per_slot_sum() -> None:
    ops = operations({"slot_sums": 5, "encryptions": 3, "decryptions": 2}, PAPER)
    assert ops["rotations"] == 5 * 11  # 16 x 128 = 2^11 slots
    assert (ops["encryptions"], ops["decryptions"]) == (3, 2)
    assert list(ops) == list(OPERATIONS)


def test_count_model_reproduces_larger_shapes_exactly() -> None:
    model, error = count_model(Arm("lora", "gk"))
    assert error < 1e-6, "the counts are not the fitted polynomial"
    # the width's square terms: d^2 plaintext products per frozen matrix
    counts = model.predict(PAPER)
    assert counts["ct_pt_mul"] > PAPER.d**2
    assert all(v >= 0 for v in counts.values())


def test_count_model_refuses_an_undetermined_design() -> None:
    shapes = [Shape(2 + i, 4, 2) for i in range(len(MONOMIALS))]  # n, h fixed
    with pytest.raises(ValueError, match="do not determine"):
        CountModel.fit(shapes, [{} for _ in shapes])
    with pytest.raises(ValueError, match="at least"):
        CountModel.fit(COUNT_DESIGN[:3], [{}] * 3)
    assert len(COUNT_DESIGN) >= len(MONOMIALS)
    assert all(s.d > 6 for s in COUNT_CHECK)


def test_cost_model_recovers_scale_and_overhead() -> None:
    rng = np.random.default_rng(0)
    unit = {"ct_ct_mul": 4e-3, "ct_pt_mul": 1e-3, "rotations": 3e-3}
    unit |= {"polyval": 2e-2, "replications": 7e-3}
    unit |= {"encryptions": 2.5e-3, "decryptions": 1e-3}
    ops = [{k: float(rng.integers(10, 5000)) for k in OPERATIONS} for _ in range(6)]
    bare = [sum(unit[k] * o[k] for k in OPERATIONS) for o in ops]
    seconds = [1.7 * b + 0.4 for b in bare]
    model = CostModel.fit(unit, ops, seconds)
    assert math.isclose(model.scale, 1.7, rel_tol=1e-6)
    assert math.isclose(model.overhead_s, 0.4, rel_tol=1e-6)
    assert math.isclose(model.predict(ops[0]), seconds[0], rel_tol=1e-9)
    with pytest.raises(ValueError, match="positive"):
        CostModel.fit(unit, ops, [0.0] * 6)
    with pytest.raises(ValueError, match="at least 2"):
        CostModel.fit(unit, ops[:1], seconds[:1])
    with pytest.raises(ValueError, match="unit_s"):
        CostModel.fit({"ct_ct_mul": 1.0}, ops, seconds)


def _growing_steps(
    widths: list[int], growth: float
) -> tuple[dict[str, float], list[dict[str, float]], list[float]]:
    """Steps whose per-operation time grows by ``growth`` per doubling of d."""
    unit = {"ct_ct_mul": 4e-3, "ct_pt_mul": 1e-3, "rotations": 3e-3}
    unit |= {"polyval": 2e-2, "replications": 7e-3}
    unit |= {"encryptions": 2.5e-3, "decryptions": 1e-3}
    ops = [
        {k: float(d * d * (i + 1)) for i, k in enumerate(OPERATIONS)} for d in widths
    ]
    bare = [sum(unit[k] * o[k] for k in OPERATIONS) for o in ops]
    seconds = [
        (1.3 + growth * math.log2(d / widths[0])) * b + 0.2
        for d, b in zip(widths, bare, strict=True)
    ]
    return unit, ops, seconds


def test_cost_model_recovers_the_growth_with_width() -> None:
    widths = [2, 3, 4, 6]
    unit, ops, seconds = _growing_steps(widths, 0.08)
    model = CostModel.fit(unit, ops, seconds, widths)
    assert math.isclose(model.growth, 0.08, rel_tol=1e-6)
    assert math.isclose(model.scale, 1.3, rel_tol=1e-6)
    assert model.reference_d == 2.0
    # the model without growth misses the wider width, the one with it does not
    unit, wide_ops, wide = _growing_steps([2, 32], 0.08)
    flat = CostModel.fit(unit, ops, seconds)
    assert abs(flat.predict(wide_ops[1]) / wide[1] - 1) > 0.05
    assert math.isclose(model.predict(wide_ops[1], 32), wide[1], rel_tol=1e-9)
    with pytest.raises(ValueError, match="give d > 0"):
        model.predict(ops[0])
    with pytest.raises(ValueError, match="widths must be one positive"):
        CostModel.fit(unit, ops, seconds, [2, 3, 0, 6])
    with pytest.raises(ValueError, match="growth must be finite"):
        CostModel(unit, growth=-1.0)


def _two_mixes(
    widths: list[int], per_rotation: float
) -> tuple[dict[str, float], list[dict[str, float]], list[float]]:
    """Two arms' steps: one with 3 rotations per product, one with 1/2 a rotation;
    every rotation costs ``per_rotation`` seconds beyond its isolated time."""
    unit = {"ct_ct_mul": 4e-3, "ct_pt_mul": 1e-3, "rotations": 3e-3}
    unit |= {"polyval": 2e-2, "replications": 7e-3}
    unit |= {"encryptions": 2.5e-3, "decryptions": 1e-3}
    ops, seconds = [], []
    for d in widths:
        for rotations_per_mul in (3.0, 0.5):
            o = {k: float(d * d) for k in OPERATIONS}
            o["rotations"] = rotations_per_mul * d * d
            ops.append(o)
            bare = sum(unit[k] * o[k] for k in OPERATIONS)
            seconds.append(0.9 * bare + per_rotation * o["rotations"] + 0.3)
    return unit, ops, seconds


def test_cost_model_recovers_an_extra_cost_per_named_operation() -> None:
    unit, ops, seconds = _two_mixes([2, 3, 4], 5e-3)
    model = CostModel.fit(unit, ops, seconds, free=["rotations"])
    assert model.extra_s["rotations"] == pytest.approx(5e-3, rel=1e-6)
    assert model.scale == pytest.approx(0.9, rel=1e-6)
    assert model.overhead_s == pytest.approx(0.3, rel=1e-6)
    # at a wider width both arms are predicted; the common scale alone cannot
    # follow the arms' different mixes of operations
    _, wide_ops, wide = _two_mixes([32], 5e-3)
    flat = CostModel.fit(unit, ops, seconds)
    for o, t in zip(wide_ops, wide, strict=True):
        assert model.predict(o) == pytest.approx(t, rel=1e-9)
    assert (
        max(abs(flat.predict(o) / t - 1) for o, t in zip(wide_ops, wide, strict=True))
        > 0.1
    )
    # with the growth term too: both are fitted, the growth comes out 0
    both = CostModel.fit(unit, ops, seconds, [2, 2, 3, 3, 4, 4], ["rotations"])
    assert both.growth == pytest.approx(0.0, abs=1e-6)
    assert both.extra_s["rotations"] == pytest.approx(5e-3, rel=1e-5)


def test_cost_model_refuses_bad_named_operations() -> None:
    unit, ops, seconds = _two_mixes([2, 3], 5e-3)
    with pytest.raises(ValueError, match="free must name distinct"):
        CostModel.fit(unit, ops, seconds, free=["additions"])
    with pytest.raises(ValueError, match="free must name distinct"):
        CostModel.fit(unit, ops, seconds, free=["rotations", "rotations"])
    with pytest.raises(ValueError, match="coefficients need at least"):
        CostModel.fit(unit, ops[:3], seconds[:3], [2, 2, 3], ["rotations", "polyval"])
    with pytest.raises(ValueError, match="extra_s"):
        CostModel(unit, extra_s={"rotations": -1.0})
    with pytest.raises(ValueError, match="extra_s"):
        CostModel(unit, extra_s={"bootstraps": 1.0})


def test_interval_carries_a_growing_error_to_the_target() -> None:
    # errors that grow by 5 points per doubling: the range at d = 768 must hold
    # the trend's value there, not only the errors seen
    errors = {8: [-0.10, -0.02], 16: [-0.15, -0.03], 32: [-0.20, -0.04]}
    lo, hi = interval(errors, 768)
    trend = -0.10 - 0.05 * math.log2(768 / 8)
    assert lo == pytest.approx(trend)
    assert hi == pytest.approx(-trend)  # symmetric: the size, not the sign
    # one held-out width: its largest error either way
    assert interval({5: [0.03, -0.06]}, 768) == (-0.06, 0.06)
    with pytest.raises(ValueError, match="finite errors"):
        interval({5: [math.nan]}, 768)
    with pytest.raises(ValueError, match="finite errors"):
        interval({}, 768)
    with pytest.raises(ValueError, match="positive width"):
        interval({5: [0.1]}, 0)


def test_a_flat_model_extrapolated_from_small_widths_is_caught_by_the_interval() -> (
    None
):
    # red team: a step whose per-operation time grows with the width, fitted
    # without the growth term; the true time at a far width must lie inside
    # the interval derived from the held-out widths' errors
    widths = [2, 3, 4, 8, 16, 32]
    unit, ops, seconds = _growing_steps(widths, 0.08)
    flat = CostModel.fit(unit, ops[:3], seconds[:3])
    errors = {
        d: [flat.predict(o) / t - 1]
        for d, o, t in zip(widths[3:], ops[3:], seconds[3:], strict=True)
    }
    _, far_ops, far = _growing_steps([2, 768], 0.08)
    predicted = flat.predict(far_ops[1])
    lo, hi = interval(errors, 768)
    assert predicted / (1 + hi) <= far[1] <= predicted / (1 + lo)


def test_unit_costs_are_positive() -> None:
    owner = KeyOwner(TRAIN_PARAMS, 2)
    unit = unit_costs(owner, 8, reps=2)
    assert set(unit) == set(OPERATIONS)
    assert all(v > 0 for v in unit.values())


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"widths": [2, 3, 4]}, "four distinct"),
        ({"widths": [2, 3, 4, 5], "held_out": 8}, "held_out"),
        ({"widths": [2, 3, 4, 5], "held_out": 4}, "three narrower"),
        ({"growth": 1}, "growth must be true or false"),
        ({"free_units": ["additions"]}, "free_units must be a list"),
        ({"free_units": "rotations"}, "free_units must be a list"),
        ({"arms": ["lora-gk"]}, "include full-softmax"),
        ({"widths": 3}, "non-empty list"),
        ({"tokens": [2, 3]}, "do not divide"),
        ({"answer_floor": "none"}, 'answer_floor must be "auto" or seconds >= 0'),
        ({"answer_floor": -0.5}, 'answer_floor must be "auto" or seconds >= 0'),
        ({"answer_floor": True}, 'answer_floor must be "auto" or seconds >= 0'),
    ],
)
def test_sweep_refuses_bad_parameters(params: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        list(finetune_sweep(params, [0]))


class _Stop(Exception):
    """Raised by a stand-in step once it has seen its arguments."""


@pytest.mark.parametrize(
    ("params", "floor"),
    [({}, "auto"), ({"answer_floor": 0}, 0.0), ({"answer_floor": 0.25}, 0.25)],
)
def test_sweep_hands_its_answer_floor_to_the_steps(
    monkeypatch: pytest.MonkeyPatch, params: dict[str, object], floor: object
) -> None:
    seen: list[object] = []

    def step(*args: object, answer_floor: object, **kwargs: object) -> None:
        seen.append(answer_floor)
        raise _Stop

    module = sys.modules[finetune_sweep.__module__]
    monkeypatch.setattr(module, "encrypted_step", step)
    monkeypatch.setattr(module, "count_model", lambda arm, seed: (None, 0.0))
    monkeypatch.setattr(module, "unit_costs", lambda owner, size: {})
    monkeypatch.setattr(module, "KeyOwner", lambda params, n: None)
    with pytest.raises(_Stop):
        list(finetune_sweep(params, [0]))
    assert seen == [floor]
    assert type(seen[0]) is type(floor)


def test_sweep_figure(tmp_path: Path) -> None:
    rows = []
    for name in ("full-softmax", "lora-gk"):
        for d, t in ((2, 1.0), (4, 2.0)):
            rows.append(
                measurement(
                    "crypto-finetune-sweep",
                    name,
                    0,
                    cost={"step_cpu_s": t},
                    params={"variant": name, "d": d, "role": "fit"},
                )
            )
        for d in (8, 768):
            rows.append(
                measurement(
                    "crypto-finetune-sweep",
                    f"curve {name}",
                    0,
                    cost={"projected_step_cpu_s": float(d)},
                    params={"variant": name, "d": d, "role": "curve"},
                )
            )
        rows.append(
            measurement(
                "crypto-finetune-sweep",
                f"paper-width {name}",
                0,
                utility={"projected_speedup": 2.0},
                cost={"projected_step_cpu_s": 768.0},
                params={
                    "variant": name,
                    "d": 768,
                    "measured_up_to_d": 4,
                    "role": "projected",
                },
            )
        )
    for r in rows:
        r.meta["spec"] = "crypto_sweep-quick"
    [(caption, path)] = figures(rows, tmp_path)
    assert path.name == "crypto_sweep-quick.png"
    assert path.stat().st_size > 0
    assert "projected" in caption
    full = [dataclasses.replace(r, meta={"spec": "crypto_sweep-full"}) for r in rows]
    made = figures(rows + full, tmp_path)
    assert [path.name for _, path in made] == [
        "crypto_sweep-full.png",
        "crypto_sweep-quick.png",
    ]


UNIT = {"ct_ct_mul": 4e-3, "ct_pt_mul": 1e-3, "rotations": 3e-3, "polyval": 2e-2}
UNIT |= {"replications": 7e-3, "encryptions": 2.5e-3, "decryptions": 1e-3}
"""Made-up unit costs (seconds) of the projection's red-team sweeps."""

Point = tuple[str, Shape, float, dict[str, int], float]
SWEPT_ARMS = ("full-softmax", "lora-gk")


def _sweep(
    seconds: Callable[[dict[str, float], int], float],
) -> tuple[dict[str, Any], list[Point]]:
    """Both arms' counted steps at d = 2, 3, 4, 6, 8, timed by ``seconds(ops, d)``.

    Returns the arms' count models and the sweep's points (arm, shape, seconds,
    step counts, spread) as :func:`~crypto.benchmark.sweep._projection` reads them.
    """
    counts = {name: count_model(Arm(*name.split("-"))) for name in SWEPT_ARMS}
    points = []
    for d in (2, 3, 4, 6, 8):
        shape = Shape(d, d, 2, 1, 4)
        for name in SWEPT_ARMS:
            step = {k: round(v) for k, v in counts[name][0].predict(shape).items()}
            points.append((name, shape, seconds(operations(step, shape), d), step, 0.0))
    return counts, points


def test_projection_states_heldout_errors_and_an_interval_that_holds() -> None:
    # red team of the projection record: steps whose per-operation time grows
    # with the width; the records must show the held-out error at every held-out
    # width and an interval of the d = 768 speed-up holding the true one
    from defense_suite.crypto.benchmark.sweep import _projection

    truth = CostModel(UNIT, scale=1.2, overhead_s=0.3, growth=0.1, reference_d=2.0)
    counts, points = _sweep(lambda ops, d: truth.predict(ops, d))
    arms = list(counts)
    fit = [p for p in points if p[1].d < 6]
    flat = CostModel.fit(
        UNIT, [operations(p[3], p[1]) for p in fit], [p[2] for p in fit]
    )
    held = {
        (n, s): flat.predict(operations(c, s)) / t - 1
        for n, s, t, c, _ in points
        if s.d >= 6
    }
    records = list(_projection(arms, counts, flat, points, held, 6, (1, 2, 4), 0))
    paper = {r.defense: r for r in records if r.defense.startswith("paper-width")}
    lora = paper["paper-width lora-gk"].utility
    assert lora["heldout_error"] == pytest.approx(
        max(abs(e) for (_, s), e in held.items() if s.d == 8)
    )
    assert {"heldout_error_d6", "heldout_error_d8"} <= set(lora)
    assert lora["heldout_error_d8"] > lora["heldout_error_d6"] > 0.01  # it grows

    def true_time(name: str) -> float:
        ops = operations(counts[name][0].predict(PAPER), PAPER)
        return truth.predict(ops, PAPER.d)

    true_speedup = true_time("full-softmax") / true_time("lora-gk")
    assert lora["projected_speedup_low"] <= true_speedup
    assert true_speedup <= lora["projected_speedup_high"]
    cost = paper["paper-width full-softmax"].cost
    assert cost["projected_step_cpu_s_low"] <= true_time("full-softmax")
    assert true_time("full-softmax") <= cost["projected_step_cpu_s_high"]
    # the interval holds the projection itself
    assert lora["projected_speedup_low"] <= lora["projected_speedup"]
    assert lora["projected_speedup"] <= lora["projected_speedup_high"]


def test_an_interval_reaching_minus_one_has_no_finite_upper_end() -> None:
    # held-out errors that fall fast with the width: the trend carried to
    # d = 768 passes -100 %, so the true value has no finite upper bound; the
    # record leaves the upper ends out and states the error size instead
    from defense_suite.crypto.benchmark.sweep import _projection

    model = CostModel(UNIT)
    error = {2: 0.0, 3: 0.0, 4: 0.0, 6: -0.2, 8: -0.4}
    counts, points = _sweep(lambda ops, d: model.predict(ops) / (1 + error[d]))
    arms = list(counts)
    held = {(name, shape): error[shape.d] for name, shape, *_ in points if shape.d >= 6}
    records = list(_projection(arms, counts, model, points, held, 6, (1, 2, 4), 0))
    lora = next(r for r in records if r.defense == "paper-width lora-gk")
    assert lora.cost["projected_step_cpu_s_interval_error"] > 1
    assert "projected_step_cpu_s_high" not in lora.cost
    assert lora.cost["projected_step_cpu_s_low"] < lora.cost["projected_step_cpu_s"]
    assert all(math.isfinite(v) for v in (*lora.cost.values(), *lora.utility.values()))


def test_replications_are_counted_where_a_slot_sum_meets_a_full_vector() -> None:
    ev = Evaluator(NumpyBackend(), 3)
    full = Value(np.arange(4.0))
    total = ev.slot_sum(full)
    assert total.one_slot
    assert not full.one_slot
    both = ev.add(total, ev.scale(ev.slot_sum(full), 2.0))
    assert both.one_slot
    assert ev.counts.get("replications", 0) == 0
    mixed = ev.sub(full, ev.square(both))
    assert not mixed.one_slot
    assert ev.counts["replications"] == 1
    ev.mul(total, full)
    ev.mask(total, np.ones(4))
    assert ev.counts["replications"] == 3
    assert operations(ev.counts, Shape(2, 1, 2, 1, 2))["replications"] == 3
