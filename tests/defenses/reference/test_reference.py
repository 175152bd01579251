from typing import Any

import numpy as np
import pytest

from defenses.reference.attacks import LabelOnlyAttack, LossThresholdAttack
from defenses.reference.defense import LabelOnly, Rounding, one_hot_argmax, round_scores
from defenses.reference.scenario import DigitsMembership
from defenses.results import Result
from defenses.testing import check_pair

_PAIRS: dict[tuple[object, ...], tuple[Result, Result]] = {}


def _checked_pair(
    attack: Any, defense: Any, min_gap: float = 0.05
) -> tuple[Result, Result]:
    """``check_pair(DigitsMembership(), attack, defense)``, once per module and pair.

    Its arms are ``run_once(scenario, attack, None | defense, 0)``: the results the
    last test compares are read from here instead of being trained again.
    """
    key = (repr(attack), repr(defense), min_gap)
    if key not in _PAIRS:
        _PAIRS[key] = check_pair(DigitsMembership(), attack, defense, min_gap=min_gap)
    return _PAIRS[key]


@pytest.mark.parametrize("defense", [Rounding(1), LabelOnly()])
def test_loss_attack_contract(defense: Any) -> None:
    undefended, defended = _checked_pair(LossThresholdAttack(), defense)
    assert undefended.success["auc"] > 0.55
    assert defended.utility["accuracy"] == pytest.approx(
        undefended.utility["accuracy"], abs=0.01
    )


@pytest.mark.parametrize("defense", [Rounding(1), LabelOnly()])
def test_label_only_attack_contract(defense: Any) -> None:
    # The gap attack is weak on digits (AUC ~0.525: 1 - test error / 2), so the
    # contract's strength margin is lowered for it.
    undefended, defended = _checked_pair(LabelOnlyAttack(), defense, min_gap=0.01)
    assert defended.success["auc"] == pytest.approx(undefended.success["auc"], abs=0.01)


def test_label_only_output_defeats_the_loss_attack_down_to_the_gap_attack() -> None:
    loss = _checked_pair(LossThresholdAttack(), LabelOnly())[1]
    gap = _checked_pair(LabelOnlyAttack(), LabelOnly(), min_gap=0.01)[0]
    assert loss.success["auc"] == pytest.approx(gap.success["auc"])


def test_post_processors():
    scores = np.array([[0.123, 0.877], [0.5, 0.5]])
    np.testing.assert_allclose(round_scores(scores, 1), [[0.1, 0.9], [0.5, 0.5]])
    np.testing.assert_array_equal(one_hot_argmax(scores), [[0, 1], [1, 0]])


def test_bad_parameters():
    with pytest.raises(ValueError, match="decimals must be an int >= 0"):
        Rounding(-1)
    with pytest.raises(ValueError, match=r"members must be a finite number in \[0.05"):
        DigitsMembership(members=0.9)
    with pytest.raises(ValueError, match=r"DigitsMembership\.members"):
        DigitsMembership(members="lots")
    with pytest.raises(ValueError, match=r"DigitsMembership\.queries"):
        DigitsMembership(queries=0)
    assert DigitsMembership(members=np.float32(0.2), queries=np.int64(5)).queries == 5
    with pytest.raises(
        ValueError, match=r"floor must be a finite number in \[1e-15, 0.5\)"
    ):
        LossThresholdAttack(floor=0.7)
