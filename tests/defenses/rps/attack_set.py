"""One instance of every registered RPS attack, for the tests that run them all."""

from __future__ import annotations

from typing import Any

from defenses.rps.attacks import ATTACKS


def attack_set(
    flips: int,
    fractions: tuple[float, float, float],
    pair: tuple[int, int, float],
    parts: tuple[int, int],
) -> list[Any]:
    """Each attack of :data:`defenses.rps.attacks.ATTACKS`, sized for a scenario.

    ``flips`` targeted flips per target; ``fractions`` of random flips, replaced
    and relabelled calibration points; ``pair`` = (source, target, fraction) of
    the pair flip; ``parts`` = (k_t, k_c) of the worst case, which takes one part
    of each around every target. A registered attack missing here is an error.
    """
    random, coverage, size = fractions
    source, target, share = pair
    params: dict[str, dict[str, Any]] = {
        "TargetedFlip": {"flips": flips},
        "RandomFlip": {"fraction": random},
        "PairFlip": {"source": source, "target": target, "fraction": share},
        "CalibrationCoverage": {"fraction": coverage},
        "CalibrationSize": {"fraction": size},
        "WorstCase": {
            "n_train_parts": parts[0],
            "n_calib_parts": parts[1],
            "train_parts": 1,
            "calib_parts": 1,
            "copies": 5,
        },
    }
    return [attack(**params[attack.__name__]) for attack in ATTACKS]
