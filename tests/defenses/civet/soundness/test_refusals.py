"""What the rules would not see is refused, and subclasses are not taken at their word.

A forward hook runs outside the traced graph and outside the rules, so ``ibp`` and
``crown`` refuse a module carrying one (``certify`` does through ``as_vae``); the
layer registry matches exact classes, so a user's subclass of ``nn.ReLU`` with
another ``forward`` is traced into and bounded as it computes; a parametrized
layer is bounded through its parametrization.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from defenses.civet import Box, UnsupportedLayerError, crown, ibp

BOX = Box(torch.zeros(1, 3), torch.ones(1, 3))


@pytest.mark.parametrize("bound", [ibp, crown])
def test_a_forward_hook_is_refused_naming_the_layer(bound: object) -> None:
    layer = nn.Linear(3, 2)
    layer.register_forward_hook(lambda module, args, out: 2 * out)
    net = nn.Sequential(layer, nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(UnsupportedLayerError, match=r"layer '0' \(Linear\) carries"):
        bound(net, BOX)  # type: ignore[operator]


class Negated(nn.ReLU):
    """A subclass of ReLU that computes -relu(x): not monotone non-decreasing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -super().forward(x)


def test_a_subclass_is_bounded_as_it_computes() -> None:
    net = nn.Sequential(nn.Linear(3, 2), Negated())
    out = ibp(net, BOX)
    xs = torch.rand(2000, 3, generator=torch.Generator().manual_seed(0))
    values = net(xs)
    assert bool((values >= out.lower - 1e-6).all())
    assert bool((values <= out.upper + 1e-6).all())
    tail = crown(net, BOX)  # after the last Linear: bounded by tracing it
    assert bool((values >= tail.lower - 1e-6).all())
    assert bool((values <= tail.upper + 1e-6).all())
    with pytest.raises(UnsupportedLayerError, match="Negated"):
        crown(nn.Sequential(nn.Linear(3, 2), Negated(), nn.Linear(2, 1)), BOX)


def test_a_parametrized_layer_is_bounded_through_its_parametrization() -> None:
    layer = parametrizations.weight_norm(nn.Linear(3, 2))
    with torch.no_grad():
        layer.parametrizations.weight.original0.mul_(3.0)  # weight = g v / |v|
    out = ibp(nn.Sequential(layer), BOX)
    xs = torch.rand(2000, 3, generator=torch.Generator().manual_seed(1))
    values = layer(xs)
    assert bool((values >= out.lower - 1e-6).all())
    assert bool((values <= out.upper + 1e-6).all())
