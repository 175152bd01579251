r"""Post-processing that follows the public plans: learning rates and weights.

Issue #32's suppressors of time-adaptive spending, as options of the DP learners
(:class:`federated.arms.TimeAdaptiveDP`, :class:`federated.arms.IDPFedAvg`):

* :func:`lr_scales` - a learning rate that follows each phase's expected batch;
* :func:`noise_weights` - an aggregate weighted by each update's noise.

Both read only the sampling rates and noise multipliers of the plans, which every
client fixes before training; they touch no data, so they are post-processing of
the DP releases and leave every client's epsilon unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .schedule import ClientSchedule


def lr_scales(plans: Sequence[ClientSchedule]) -> list[list[float]]:
    r"""Learning-rate multipliers that follow each phase's expected batch.

    Client :math:`n`'s round :math:`t` runs at rate :math:`q_{n,t}`; its multiplier
    is :math:`q_{n,t} / \bar q_n` with :math:`\bar q_n` the mean rate of its plan, so
    the mean learning rate over the rounds is unchanged, and the step
    :math:`\eta\, q_{n,t}/\bar q_n \cdot (\sum_B g_i + \xi)/(q_{n,t} n)` divides the
    clipped noisy sum by the *average* expected batch: a phase with larger batches
    takes larger steps. Uniform plans get 1 everywhere.
    """
    out = []
    for schedule in plans:
        rates = schedule.rates
        mean = float(np.mean(rates))
        out.append([q / mean for q in rates])
    return out


def noise_weights(
    plans: Sequence[ClientSchedule],
    sizes: Sequence[int],
    scales: Sequence[Sequence[float]] | None = None,
) -> list[list[float]]:
    r"""Inverse-noise-variance aggregation weights of every round.

    Client :math:`n`'s update in round :math:`t` carries Gaussian noise of standard
    deviation :math:`\propto s_{n,t}\,\eta\,\sigma C / (q_{n,t} |D_n|)` per step
    (:math:`s_{n,t}` its learning-rate multiplier), so its weight is
    :math:`w_{n,t} \propto (q_{n,t} |D_n| / (s_{n,t} \sigma_{n,t}))^2`, normalised
    over clients. Strict clients (small rates) count less; the weights use the
    public plans only.
    """
    rounds = len(plans[0].rounds)
    out = []
    for t in range(rounds):
        raw = []
        for n, schedule in enumerate(plans):
            r = schedule.rounds[t]
            s = 1.0 if scales is None else scales[n][t]
            raw.append((r.rate * sizes[n] / (s * r.sigma)) ** 2)
        total = sum(raw)
        out.append([w / total for w in raw])
    return out
