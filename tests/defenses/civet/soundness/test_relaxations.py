"""The linear relaxations (CROWN) against sampling, and every one of them tested.

:data:`defenses.civet.crown.RELAXATIONS` lists the layer classes CROWN relaxes:
ReLU by two lines (:func:`~defenses.civet.crown.relu_relaxation`) and Linear
exactly. The ReLU lines must hold every sampled pre-activation in the box (zero
width, one end at 0, both signs), and CROWN's output box must hold the outputs of
random ReLU MLPs (with a final monotone layer) at sampled inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from defenses.civet.bounds import Box
from defenses.civet.crown import crown, relu_relaxation
from tests.defenses.civet.soundness.sampling import assert_inside, draw_box, points

EXAMPLES = settings(max_examples=15, deadline=None)


@EXAMPLES
@given(data=st.data())
def check_relu_lines(data: st.DataObject) -> None:
    box = draw_box(data, (6,), (0.0,))
    if data.draw(st.booleans(), "an end at zero"):
        box = Box(box.lower.clamp(max=0.0), box.upper.clamp(min=0.0))
    upper_slope, intercept, lower_slope = relu_relaxation(box)
    for z in points(box, (0.0,), count=40):
        value = torch.relu(z)
        slack = 1e-12 * (1.0 + box.upper.abs() + box.lower.abs())
        assert bool((lower_slope * z <= value + slack).all()), "lower line"
        assert bool((value <= upper_slope * z + intercept + slack).all()), "chord"


@EXAMPLES
@given(data=st.data())
def check_crown_mlp(data: st.DataObject) -> None:
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "net"))
    sizes = [data.draw(st.integers(1, 5), "width") for _ in range(4)]
    layers: list[nn.Module] = []
    for i in range(3):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
    layers[-1] = data.draw(st.sampled_from([nn.Sigmoid(), nn.Tanh(), nn.Identity()]))
    net = nn.Sequential(*layers).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    box = draw_box(data, (sizes[0],))
    bound = crown(net, box)
    with torch.no_grad():
        for x in points(box, (), count=40):
            assert_inside(bound, net(x), "crown")


RELAXATION_CASES: dict[type[nn.Module], Callable[[], None]] = {
    nn.ReLU: check_relu_lines,
    nn.Linear: check_crown_mlp,
}
"""A property test for every key of :data:`defenses.civet.crown.RELAXATIONS`."""


def test_relu_lines_hold_against_sampling() -> None:
    check_relu_lines()


def test_crown_holds_against_sampling() -> None:
    check_crown_mlp()
