r"""Where time-adaptive spending helps: paired differences over a sweep (issue #32).

For every setting of a sweep (data set, model, budgets, rounds) and every
time-adaptive arm (saving ratio, options), the paired difference

.. math::

    \Delta_s = a_s^{TA} - a_s^{unif}

of a metric (test accuracy by default) between the time-adaptive run and the
uniform-spending run (IDP-FedAvg, without options) of the same seed :math:`s` and
setting, summarised by its Student-t 95 % interval over seeds
(:func:`defenses.results.t_interval`). A cell *helps* when the interval lies above
0, *hurts* when it lies below, and *does nothing* otherwise.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from defenses.results import (
    Interval,
    Result,
    interval_outcome,
    paired_differences,
    t_interval,
)

TIME_ADAPTIVE = "federated-time-adaptive"
UNIFORM = "federated-idp-fedavg"
OUTCOMES = {"reproduced": "helps", "contradicted": "hurts", "inconclusive": "nothing"}


@dataclass(frozen=True)
class Cell:
    """One sweep cell: its setting, the time-adaptive arm and the paired interval."""

    dataset: str
    model: str
    budgets: str
    rounds: int
    save_ratio: float
    options: str
    interval: Interval

    @property
    def outcome(self) -> str:
        """``"helps"``, ``"hurts"`` or ``"nothing"`` (the interval against 0)."""
        return OUTCOMES[interval_outcome(self.interval, "higher")]


def _options(result: Result) -> str:
    defense = result.params.get("defense", {})
    on = [
        k
        for k in ("strict_only", "lr_follows_batch", "noise_weighted")
        if defense.get(k)
    ]
    return "+".join(on) or "plain"


def _plain_uniform(result: Result) -> bool:
    defense = result.params.get("defense", {})
    return result.defense.startswith(UNIFORM) and not defense.get("noise_weighted")


def sweep_cells(
    results: Iterable[Result], metric: str = "utility.accuracy"
) -> list[Cell]:
    """Paired intervals of every time-adaptive arm against plain uniform spending.

    Arms with fewer than two paired seeds are left out. Cells come sorted by data
    set, model, budgets, options, rounds and saving ratio.
    """
    runs = list(results)
    baseline = [r for r in runs if _plain_uniform(r)]
    arms: dict[tuple[str, ...], list[Result]] = defaultdict(list)
    for r in runs:
        if r.defense.startswith(TIME_ADAPTIVE):
            arms[r.arm].append(r)
    cells = []
    for arm in arms.values():
        first = arm[0]
        scenario = first.params.get("scenario", {})
        diffs = paired_differences(arm, baseline, metric)
        if len(diffs) < 2:
            continue
        cells.append(
            Cell(
                dataset=str(scenario.get("dataset", "digits")),
                model=str(scenario.get("model", "softmax")),
                budgets=json.dumps(scenario.get("budgets")),
                rounds=int(scenario.get("rounds", 30)),
                save_ratio=float(
                    first.params.get("defense", {}).get("save_ratio", 0.7)
                ),
                options=_options(first),
                interval=t_interval(diffs),
            )
        )
    return sorted(
        cells,
        key=lambda c: (
            c.dataset,
            c.model,
            c.budgets,
            c.options,
            c.rounds,
            c.save_ratio,
        ),
    )
