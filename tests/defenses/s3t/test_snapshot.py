"""The state snapshot behind S3T's conformance pass, tried on awkward state.

Cycles and aliases keep the walk finite, NaN equals NaN, deep nesting falls back
to identity, and a change anywhere in a container or object is a difference at
its own path.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from defenses.s3t.snapshot import MAX_DEPTH, capture, differences
from tests.defenses.s3t.user_modules import UserMLP


def _own(module: nn.Module) -> dict[str, object]:
    return dict(capture(module).own)


def test_unchanged_state_has_no_difference_nan_and_cycles_included() -> None:
    module = UserMLP()
    loop: list[object] = [1.0]
    loop.append(loop)
    module.state = {"nan": float("nan"), "loop": loop, "arr": np.arange(3.0)}
    module.alias = module.state  # one object at two paths
    before, after = capture(module), capture(module)
    assert differences(before.own, after.own) == []
    assert after.own["alias"] == ("ref", "state")


def test_a_change_is_named_at_its_own_path() -> None:
    module = UserMLP()
    module.config = {"scales": [1.0, 2.0], "inner": type("Box", (), {})()}
    module.config["inner"].count = 0
    before = _own(module)
    module.config["scales"][1] = 3.0
    module.config["inner"].count = 1
    changed = differences(before, _own(module))
    assert changed == ["config['scales'][1]", "config['inner'].count"]


def test_a_parameter_changed_in_place_and_its_storage_are_recorded() -> None:
    module = UserMLP()
    snapshot = capture(module)
    ptr = module.fc1.weight.untyped_storage().data_ptr()
    assert snapshot.storages[ptr] == "fc1.weight"
    assert snapshot.kinds["fc1.weight"] == "parameter"
    with torch.no_grad():
        module.fc1.weight[0, 0] += 1.0
    assert differences(snapshot.own, capture(module).own) == ["fc1.weight"]


def test_nesting_beyond_the_depth_limit_is_compared_by_identity() -> None:
    module = UserMLP()
    deep: list[object] = [0]
    for _ in range(MAX_DEPTH + 3):
        deep = [deep]
    module.deep = deep
    before = _own(module)
    innermost = deep
    for _ in range(MAX_DEPTH + 3):
        innermost = innermost[0]  # type: ignore[assignment]
    innermost[0] = 1  # type: ignore[index]
    assert differences(before, _own(module)) == []  # out of reach, documented
    module.deep = [deep]  # a new object where identity is compared
    assert differences(before, _own(module))


def test_a_closure_in_a_hook_is_shared_state() -> None:
    module = UserMLP()
    count = [0]

    def hook(layer: nn.Module, args: object, out: torch.Tensor) -> None:
        count[0] += 1

    module.fc1.register_forward_hook(hook)
    before = capture(module)
    module(torch.zeros(2, 8))
    changed = differences(before.shared, capture(module).shared)
    assert len(changed) == 1
    assert changed[0].endswith("hook.<closure count>[0]")
