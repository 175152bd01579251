r"""A CROWN-style linear relaxation for ReLU MLPs (tighter than plain IBP).

CROWN (Zhang et al., "Efficient Neural Network Robustness Certification with General
Activation Functions", NeurIPS 2018) bounds each output of
:math:`f = W_L \circ \mathrm{ReLU} \circ \dots \circ W_1` by a linear function of
the input, propagated backwards: an unstable ReLU with pre-activation bounds
:math:`l < 0 < u` is sandwiched between :math:`\alpha z` (:math:`\alpha = 1` if
:math:`u > -l`, else 0) and the chord :math:`\frac{u}{u - l}(z - l)`; a row of the
backward matrix with a positive coefficient takes the upper line for an upper bound
and the lower line for a lower bound, and vice versa. The final linear function is
maximised (minimised) in closed form over the input box. Pre-activation bounds come
from IBP (the CROWN-IBP variant, Zhang et al., ICLR 2020), and the result is
intersected with the IBP bound, so it is never looser than IBP.

Supported: a sequence of Linear and ReLU layers, optionally followed by monotone
elementwise layers (e.g. the decoder's final Sigmoid), which are applied to the
bounds. Anything else raises :class:`~defenses.civet.bounds.UnsupportedLayerError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from defenses.civet.bounds import Box, UnsupportedLayerError
from defenses.civet.graph import ibp
from defenses.civet.state import check_hooks

RELAXATIONS = {nn.ReLU: "relu_relaxation", nn.Linear: "exact"}
"""Layer classes CROWN relaxes (exact classes): ReLU's lines, Linear exactly."""


def _flatten(modules: Sequence[nn.Module]) -> list[nn.Module]:
    out: list[nn.Module] = []
    for module in modules:
        if type(module) is nn.Sequential:
            out.extend(_flatten(list(module)))
        else:
            out.append(module)
    return out


def _split(layers: list[nn.Module]) -> tuple[list[nn.Module], list[nn.Module]]:
    """The Linear/ReLU core (ending in a Linear) and the trailing layers."""
    end = max(
        (i for i, layer in enumerate(layers) if type(layer) is nn.Linear),
        default=-1,
    )
    if end < 0:
        raise UnsupportedLayerError("CROWN needs at least one Linear layer")
    core, tail = layers[: end + 1], layers[end + 1 :]
    for layer in core:
        if type(layer) not in RELAXATIONS or getattr(layer, "inplace", False):
            raise UnsupportedLayerError(
                f"CROWN supports Linear and ReLU layers before the last Linear, got "
                f"{layer!r} ({type(layer).__name__}); use interval propagation instead"
            )
        if parametrize.is_parametrized(layer):
            raise UnsupportedLayerError(
                f"CROWN does not support the parametrized layer {layer!r}"
            )
    return core, tail


def relu_relaxation(
    box: Box,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Upper slope, upper intercept and lower slope of ReLU over ``box``.

    For every :math:`z \in [l, u]`: ``lower_slope * z <= relu(z) <= upper_slope *
    z + intercept`` (the chord above, a line through 0 of slope 0 or 1 below).
    """
    lower, upper = box.lower, box.upper
    active, dead = lower >= 0, upper <= 0
    unstable = ~(active | dead)
    gap = torch.where(unstable, upper - lower, torch.ones_like(upper))
    chord = torch.where(unstable, upper / gap, active.to(upper.dtype))
    intercept = torch.where(unstable, -lower * chord, torch.zeros_like(upper))
    low_slope = torch.where(
        unstable, (upper > -lower).to(upper.dtype), active.to(upper.dtype)
    )
    return chord, intercept, low_slope


def _backward(
    core: list[nn.Module], pre: list[Box], box: Box, upper: bool
) -> torch.Tensor:
    last = core[-1]
    assert type(last) is nn.Linear
    n = box.lower.shape[0]
    A = last.weight.unsqueeze(0).expand(n, -1, -1)
    c = (
        last.bias.unsqueeze(0).expand(n, -1)
        if last.bias is not None
        else torch.zeros(n, last.out_features, dtype=A.dtype)
    )
    relus = iter(reversed(pre))
    for layer in reversed(core[:-1]):
        if type(layer) is nn.Linear:
            if layer.bias is not None:
                c = c + A @ layer.bias
            A = A @ layer.weight
            continue
        chord, intercept, low_slope = relu_relaxation(next(relus))
        pos, neg = A.clamp(min=0), A.clamp(max=0)
        if upper:
            c = c + (pos * intercept.unsqueeze(1)).sum(dim=2)
            A = pos * chord.unsqueeze(1) + neg * low_slope.unsqueeze(1)
        else:
            c = c + (neg * intercept.unsqueeze(1)).sum(dim=2)
            A = pos * low_slope.unsqueeze(1) + neg * chord.unsqueeze(1)
    centre = (A @ box.center.unsqueeze(2)).squeeze(2)
    spread = (A.abs() @ box.radius.unsqueeze(2)).squeeze(2)
    return c + centre + spread if upper else c + centre - spread


def crown(module: nn.Module, box: Box) -> Box:
    """CROWN-IBP output bounds of a ReLU MLP over ``box`` (never looser than IBP).

    Parameters
    ----------
    module : torch.nn.Module
        Linear and ReLU layers (nested sequentials allowed), optionally followed by
        layers :func:`~defenses.civet.bounds.ibp` supports (applied to the bounds).
    box : Box
        Input box of shape (n, features).

    Raises
    ------
    UnsupportedLayerError
        If a layer before the last Linear is not Linear or ReLU.
    """
    check_hooks(module, type(module).__name__)
    layers = _flatten([module])
    core, tail = _split(layers)
    current = box.validate()
    pre: list[Box] = []
    for layer in core:
        if isinstance(layer, nn.ReLU):
            pre.append(current)
        current = ibp(layer, current)
    lower = torch.maximum(current.lower, _backward(core, pre, box, upper=False))
    upper = torch.minimum(current.upper, _backward(core, pre, box, upper=True))
    out = Box(lower, torch.maximum(upper, lower))
    return ibp(nn.Sequential(*tail), out) if tail else out
