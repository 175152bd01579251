"""A rule cannot land without a property test: the registries against the cases.

Every key of the layer-rule registry (:data:`defenses.civet.bounds.LAYER_RULES`),
the tensor-function and tensor-method rule tables
(:data:`defenses.civet.operations.FUNCTIONS`, ``METHODS``) and the CROWN
relaxations (:data:`defenses.civet.crown.RELAXATIONS`) must have a sampling case in
this folder; a case without a rule is stale and fails too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from defenses.civet import operations
from defenses.civet.activations import softplus
from defenses.civet.bounds import LAYER_RULES, Box, monotone
from defenses.civet.crown import RELAXATIONS
from tests.defenses.civet.soundness.cases import FUNCTION_CASES, METHOD_CASES
from tests.defenses.civet.soundness.layer_cases import LAYER_CASES
from tests.defenses.civet.soundness.sampling import assert_inside, points
from tests.defenses.civet.soundness.test_relaxations import RELAXATION_CASES

REGISTRIES: dict[str, tuple[Iterable[Any], Iterable[Any]]] = {
    "layer rules": (LAYER_RULES, LAYER_CASES),
    "function rules": (operations.FUNCTIONS, FUNCTION_CASES),
    "method rules": (operations.METHODS, METHOD_CASES),
    "relaxations": (RELAXATIONS, RELAXATION_CASES),
}


def untested(registry: Iterable[Any], cases: Iterable[Any]) -> list[str]:
    """Registry keys without a case, and cases without a registry key."""
    keys, tested = set(registry), set(cases)
    return [f"no property test: {k!r}" for k in keys - tested] + [
        f"stale case: {k!r}" for k in tested - keys
    ]


@pytest.mark.parametrize("name", list(REGISTRIES))
def test_every_rule_has_a_property_test(name: str) -> None:
    registry, cases = REGISTRIES[name]
    assert untested(registry, cases) == []


def test_a_rule_added_without_a_property_test_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(operations.FUNCTIONS, torch.erf, lambda box: box)
    monkeypatch.setitem(LAYER_RULES, nn.Mish, lambda layer: lambda box: box)
    assert untested(operations.FUNCTIONS, FUNCTION_CASES) == [
        f"no property test: {torch.erf!r}"
    ]
    assert untested(LAYER_RULES, LAYER_CASES) == [f"no property test: {nn.Mish!r}"]


@pytest.mark.parametrize(
    ("beta", "threshold"), [(1.0, 0.0), (1.0, 1e-3), (2.0, 0.5), (-1.0, 0.0)]
)
def test_the_sampling_test_catches_the_old_softplus_rule(
    beta: float, threshold: float
) -> None:
    """The harness has teeth: the monotone rule Softplus had fails it, the new holds."""
    switch = threshold / beta
    box = Box(
        torch.tensor([[switch - 0.1]], dtype=torch.float64),
        torch.tensor([[switch + 0.1]], dtype=torch.float64),
    )

    def op(x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x, beta, threshold)

    old = monotone(box, op)

    def check_old() -> None:
        for x in points(box, (switch,)):
            assert_inside(old, op(x), "old softplus")

    with pytest.raises(AssertionError, match=r"outside the rule's box|upside down"):
        check_old()
    new = softplus(box, beta, threshold)
    for x in points(box, (switch,)):
        assert_inside(new, op(x), "softplus")
