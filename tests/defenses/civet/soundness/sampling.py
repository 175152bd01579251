"""Random boxes (degenerate ones included) and dense sampling inside them.

:func:`draw_box` draws a batch of boxes: centres at several scales, half-widths
from 0 (a point) and 1e-12 through 6, some coordinates of zero width, and, half of
the time, centres placed on one of the op's special points (a threshold, a
minimiser, a clamp limit) so that boxes straddle it. :func:`points` returns the
box's ends, its corners, uniform points and every special point (and its two
floating-point neighbours) clamped into the box. :func:`assert_inside` checks that
every sampled output lies in the rule's box, up to a rounding slack of 1e-9
relative, and that the box is not upside down.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from defenses.civet.bounds import Box

D = torch.float64
WIDTHS = (0.0, 1e-12, 1e-6, 0.05, 0.5, 2.0, 6.0)
SLACK = 1e-9


def draw_box(
    data: st.DataObject, shape: tuple[int, ...], specials: Sequence[float] = ()
) -> Box:
    """A batch of 1-2 boxes of rows of ``shape`` (see the module docstring)."""
    n = data.draw(st.integers(1, 2), "rows")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "box seed"))
    scale = data.draw(st.sampled_from([0.3, 1.0, 3.0]), "scale")
    centre = scale * torch.randn((n, *shape), generator=g, dtype=D)
    width = data.draw(st.sampled_from(WIDTHS), "width")
    half = width * torch.rand((n, *shape), generator=g, dtype=D)
    if data.draw(st.booleans(), "some zero widths"):
        half = torch.where(torch.rand(half.shape, generator=g) < 0.3, 0.0, half)
    on_special: bool = data.draw(st.booleans(), "on a special point")
    if specials and on_special:
        at = data.draw(st.sampled_from(list(specials)), "special")
        shift = (2 * torch.rand(half.shape, generator=g, dtype=D) - 1) * half
        centre = at + shift
    return Box(centre - half, centre + half)


def points(
    box: Box, specials: Sequence[float], count: int = 96, seed: int = 0
) -> Iterator[torch.Tensor]:
    """Batches of the box's shape: ends, corners, uniform and special points."""
    g = torch.Generator().manual_seed(seed)
    low, high = box.lower, box.upper
    yield low
    yield high
    for i in range(count):
        t = torch.rand(low.shape, generator=g, dtype=D)
        yield low + (high - low) * (t.round() if i % 3 == 0 else t)
    for s in specials:
        value = torch.tensor(float(s), dtype=D)
        for near in (
            torch.nextafter(value, torch.tensor(-torch.inf, dtype=D)),
            value,
            torch.nextafter(value, torch.tensor(torch.inf, dtype=D)),
        ):
            yield torch.minimum(torch.maximum(near.expand_as(low), low), high)
            mixed = low + (high - low) * torch.rand(low.shape, generator=g, dtype=D)
            pick = torch.rand(low.shape, generator=g) < 0.5
            yield torch.where(pick, near.clamp(low, high), mixed)


def flat(value: Any) -> list[Any]:
    """A box, tensor or tuple of them as a list."""
    if isinstance(value, tuple | list):
        return [v for item in value for v in flat(item)]
    return [value]


def assert_inside(bound: Any, value: Any, what: str) -> None:
    """Every output tensor of ``value`` lies in the matching box of ``bound``."""
    boxes, values = flat(bound), flat(value)
    assert len(boxes) == len(values), f"{what}: {len(boxes)} boxes, {len(values)}"
    for box, out in zip(boxes, values, strict=True):
        assert isinstance(box, Box), f"{what}: rule returned {type(box).__name__}"
        assert box.lower.shape == out.shape, f"{what}: shape {box.lower.shape}"
        assert not bool(torch.isnan(box.lower).any() | torch.isnan(box.upper).any())
        assert not bool(torch.isnan(out).any()), f"{what}: the op gave NaN"
        assert bool((box.lower <= box.upper).all()), f"{what}: box upside down"
        finite = torch.nan_to_num(box.lower.abs(), posinf=0.0) + torch.nan_to_num(
            box.upper.abs(), posinf=0.0
        )
        slack = SLACK * (1.0 + finite)
        below = out < box.lower - slack
        above = out > box.upper + slack
        if bool(below.any() | above.any()):
            i = torch.nonzero(below | above)[0]
            raise AssertionError(
                f"{what}: sampled output {float(out[tuple(i)])!r} outside the rule's "
                f"box [{float(box.lower[tuple(i)])!r}, "
                f"{float(box.upper[tuple(i)])!r}] at index {i.tolist()}"
            )
