from __future__ import annotations

import numpy as np
import pytest
import torch

from defenses.oracle import QueryOracle
from defenses.reference.attacks import MembershipView
from defenses.s3t import S3T, SISA, ResidualMLP
from defenses.s3t.attacks import CanaryAttack, lineage_audit, twin_test
from defenses.s3t.backbone import frozen_copy


@pytest.mark.parametrize("cls", [S3T, SISA])
def test_twin_test_is_bit_exact_and_has_power(tiny, fast, cls) -> None:
    target = int(tiny.ids[17])
    report = twin_test(
        lambda: cls(tiny.backbone, 2, 2, **fast),
        tiny.X,
        tiny.y,
        tiny.ids,
        target,
        probe=tiny.test_X,
    )
    assert report.exact
    assert report.tensors_equal
    assert report.outputs_equal
    assert report.mismatched == ()
    assert report.n_switched_off > 0
    assert report.switched_off_differed


def test_twin_test_rejects_an_unknown_target(tiny, fast) -> None:
    with pytest.raises(ValueError, match="not among the ids"):
        twin_test(
            lambda: S3T(tiny.backbone, 2, 2, **fast), tiny.X, tiny.y, tiny.ids, -5
        )


def _leaky(tiny) -> ResidualMLP:
    torch_gen = torch.Generator().manual_seed(0)
    backbone = ResidualMLP(64, 16, 16, 2, 10, norm="batch", generator=torch_gen)
    return frozen_copy(backbone).train()


def test_negative_control_batch_norm_fails_both_audits(tiny) -> None:
    backbone = _leaky(tiny)
    settings = {"epochs": 1, "batch_size": 30, "rank": 2, "allow_shared_state": True}
    target = int(tiny.ids[17])
    report = twin_test(
        lambda: S3T(backbone, 2, 2, **settings), tiny.X, tiny.y, tiny.ids, target
    )
    assert not report.exact
    assert any(name.startswith("backbone/") for name in report.mismatched)
    model = S3T(backbone, 2, 2, **settings).fit(tiny.X, tiny.y, tiny.ids)
    model.delete([target])
    audit = lineage_audit(model, [target])
    assert not audit.clean
    assert audit.offenders == ("backbone/buffers",)


def test_lineage_audit_flags_a_stage_that_saw_the_point(tiny, fast) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    target = int(tiny.ids[0])
    audit = lineage_audit(model, [target])
    assert not audit.clean
    assert audit.offenders
    assert not audit.rows_erased
    model.delete([target])
    assert lineage_audit(model, [target]).clean


def test_canary_attack_scores_the_planted_label() -> None:
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]])
    oracle = QueryOracle(lambda x: probs[: len(x)])
    view = MembershipView(oracle, np.zeros((3, 2)), np.array([0, 0, 1]))
    scores = CanaryAttack().run(view, np.random.default_rng(0))
    np.testing.assert_allclose(scores, np.log([0.9 / 0.1, 0.2 / 0.8, 1.0]))
    assert oracle.used == 3


def test_canary_attack_bad_floor() -> None:
    for floor in (0.7, 1e-16, "0.1"):
        with pytest.raises(ValueError, match=r"CanaryAttack\.floor"):
            CanaryAttack(floor=floor)
