"""Every interval rule against dense sampling, over random boxes and parameters.

For each key of the three registries (layer classes, tensor functions, tensor
methods) a case of :mod:`cases` / :mod:`layer_cases` draws the op's parameters,
degenerate ones included, and a batch of boxes (points, 1e-12-wide boxes, boxes
on the op's special points); the rule's box must hold the op's output at the box's
ends, corners, uniform points and special points. The function and method cases
are traced with torch.fx and bounded by :func:`~defenses.civet.graph.propagate`,
and each checks that its graph calls the registry key it stands for. Hypothesis
example counts are bounded (the CI runs them derandomized).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import fx, nn

from defenses.civet.bounds import LAYER_RULES, Box
from defenses.civet.graph import ibp, propagate, trace
from tests.defenses.civet.soundness.cases import FUNCTION_CASES, METHOD_CASES, Op
from tests.defenses.civet.soundness.layer_cases import LAYER_CASES
from tests.defenses.civet.soundness.sampling import assert_inside, draw_box, points

EXAMPLES = settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Wrap(nn.Module):
    """An op on a batch as a module, so that fx traces the calls inside it."""

    def __init__(self, op: Op) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> Any:
        return self.op(x)


def _calls(graph: fx.GraphModule, key: Any, method: bool) -> bool:
    op = "call_method" if method else "call_function"
    return any(n.op == op and n.target == key for n in graph.graph.nodes)


def _check_traced(key: Any, method: bool, data: st.DataObject) -> None:
    setup = (METHOD_CASES if method else FUNCTION_CASES)[key](data)
    graph = trace(Wrap(setup.op))
    assert _calls(graph, key, method), f"the case of {key!r} does not call it"
    box = draw_box(data, setup.shape, setup.specials)
    bound = propagate(graph, box)
    for x in points(box, setup.specials, count=40):
        assert_inside(bound, setup.op(x), repr(key))


def _stable_id(key: Any) -> str:
    """A test id without a memory address (pytest-xdist's workers must agree)."""
    owner = getattr(key, "__module__", None) or type(getattr(key, "__self__", None))
    owner = owner if isinstance(owner, str) else owner.__name__
    return f"{owner}.{getattr(key, '__qualname__', repr(key))}"


@pytest.mark.parametrize("key", list(FUNCTION_CASES), ids=_stable_id)
@EXAMPLES
@given(data=st.data())
def test_function_rule_holds_against_sampling(key: Any, data: st.DataObject) -> None:
    _check_traced(key, False, data)


@pytest.mark.parametrize("key", list(METHOD_CASES))
@EXAMPLES
@given(data=st.data())
def test_method_rule_holds_against_sampling(key: str, data: st.DataObject) -> None:
    _check_traced(key, True, data)


@pytest.mark.parametrize("cls", list(LAYER_CASES), ids=lambda c: c.__name__)
@EXAMPLES
@given(data=st.data())
def test_layer_rule_holds_against_sampling(
    cls: type[nn.Module], data: st.DataObject
) -> None:
    setup = LAYER_CASES[cls](data)
    layer = setup.op
    assert type(layer) is cls
    assert cls in LAYER_RULES
    box = draw_box(data, setup.shape, setup.specials)
    bound = ibp(layer, box)
    with torch.no_grad():
        for x in points(box, setup.specials, count=40):
            assert_inside(bound, layer(x), cls.__name__)


@pytest.mark.parametrize(
    ("beta", "threshold"), [(1.0, 0.0), (1.0, 1e-3), (2.0, 0.0), (-1.0, 0.0)]
)
def test_softplus_jump_is_inside_the_box(beta: float, threshold: float) -> None:
    """The issue's case: Softplus(threshold=0) on [-0.1, 0.1] is [~0, log 2]."""
    layer = nn.Softplus(beta, threshold).double()
    box = draw_box_at(-0.1, 0.1)
    out = ibp(layer, box)
    xs = torch.linspace(-0.1, 0.1, 20001, dtype=torch.float64)[:, None]
    values = layer(xs)
    assert float(out.lower) <= float(values.min()) + 1e-15
    assert float(out.upper) >= float(values.max()) - 1e-15
    assert float(out.upper) - float(out.lower) >= 0.69 / abs(beta) - 0.2


def draw_box_at(low: float, high: float) -> Box:
    return Box(
        torch.tensor([[low]], dtype=torch.float64),
        torch.tensor([[high]], dtype=torch.float64),
    )
