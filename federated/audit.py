r"""Canary audit of the per-client accountant: an empirical epsilon lower bound.

Threat model: an observer of one client's updates (the honest-but-curious server)
who knows the client's schedule. The challenger adds a *Dirac canary* to the client
with probability 1/2 per trial: a record whose clipped gradient is :math:`C u` for a
secret unit vector :math:`u`, every other record having zero gradient along
:math:`u` (the worst case of Nasr et al., 2021, "Adversary instantiation"). Each
trial replays the client's rounds with the client's own batch sampler and Gaussian
mechanism (:func:`federated.client.record_inclusion`,
:func:`federated.client.privatize`);
the observer sees the projection of every released step on :math:`u`, in units of
:math:`C`: :math:`o_s = b_s + \sigma_s z_s`, where :math:`b_s` says whether the
canary was in step :math:`s`'s batch. It scores a trial two ways: the Neyman-Pearson
log-likelihood ratio of Poisson inclusion at the claimed rates,

.. math::

    \Lambda = \sum_s \log\big(1 - q_s + q_s\, e^{(2 o_s - 1)/(2\sigma_s^2)}\big),

and a matched filter :math:`\sum_s w_s o_s / \sigma_s^2`, where :math:`w_s` is the
canary's inclusion frequency at step :math:`s` measured by running the client's
sampler with fresh randomness (the observer knows the client's code, not its
random draws). It picks the statistic and threshold on half the trials and converts
the other half's TPR and FPR into an epsilon lower bound with Clopper-Pearson
intervals (:func:`defenses.metrics.epsilon_lower_bound`; Jagielski et al., 2020). A
correct accountant is never below the bound (up to the 95% confidence). An
accountant fed the wrong rate, missing the saving steps, or assuming Poisson sampling
where the client cut fixed-size batches in order claims less than the mechanism
leaks; the negative controls use settings where that gap is large, and the audit is
run at a ``delta`` large enough (e.g. 1e-2) for a few thousand trials to resolve it:
an (epsilon(delta), delta) curve must hold at every delta.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from defenses.arrays import BoolArray, FloatArray
from defenses.metrics import epsilon_lower_bound

from .client import Sampling, StepPlan, privatize, record_inclusion


def observe_canary(
    plans: Sequence[StepPlan],
    canary_in: BoolArray,
    n_records: int,
    sampling: Sampling,
    rng: np.random.Generator,
) -> FloatArray:
    """Replay ``plans`` once per trial; return the observed projections (M, steps).

    The canary is record 0 of ``n_records`` in the trials where ``canary_in`` is
    set, absent otherwise. A non-private step (``sigma=None``) releases the batch
    mean unnoised; its projection is then 1 exactly when the canary was sampled.
    """
    flags = np.asarray(canary_in, dtype=bool)
    if flags.ndim != 1 or flags.size == 0:
        raise ValueError("canary_in must be a non-empty 1-D boolean array")
    if n_records < 1:
        raise ValueError(f"n_records must be >= 1, got {n_records}")
    if not plans:
        raise ValueError("the audited client ran no rounds")
    trials = flags.size
    columns: list[FloatArray] = []
    for plan in plans:
        drawn = record_inclusion(
            rng, trials, n_records, plan.rate, plan.steps, sampling
        )
        included = (drawn & flags[:, None]).astype(np.float64)
        for s in range(plan.steps):
            if plan.sigma is None:
                columns.append(included[:, s])
                continue
            expected = plan.rate * n_records
            released = privatize(included[:, s], plan.sigma, 1.0, expected, rng)
            columns.append(released * expected)
    return np.stack(columns, axis=1)


def likelihood_ratio(
    observations: FloatArray, rates: Sequence[float], sigmas: Sequence[float | None]
) -> FloatArray:
    """Log-likelihood ratio (canary in vs out) of each trial at the claimed schedule.

    Non-private steps (``sigma=None``) add a large constant when the canary is seen.
    """
    obs = np.asarray(observations, dtype=np.float64)
    if obs.ndim != 2 or obs.shape[1] != len(rates) or len(rates) != len(sigmas):
        raise ValueError(
            f"observations {obs.shape} do not match {len(rates)} rates and "
            f"{len(sigmas)} sigmas"
        )
    score = np.zeros(obs.shape[0])
    for s, (q, sigma) in enumerate(zip(rates, sigmas, strict=True)):
        if sigma is None:
            score += 1e6 * (obs[:, s] > 0.5)
            continue
        a = (2.0 * obs[:, s] - 1.0) / (2.0 * sigma**2)
        if q >= 1.0:
            score += a
        else:
            score += np.logaddexp(math.log1p(-q), math.log(q) + a)
    return score


def inclusion_profile(
    plans: Sequence[StepPlan],
    n_records: int,
    sampling: Sampling,
    rng: np.random.Generator,
    replays: int = 200,
) -> FloatArray:
    """Frequency with which record 0 is in each step's batch, over fresh replays."""
    return np.concatenate(
        [
            record_inclusion(rng, replays, n_records, p.rate, p.steps, sampling).mean(0)
            for p in plans
        ]
    )


def matched_filter(
    observations: FloatArray, weights: FloatArray, sigmas: Sequence[float | None]
) -> FloatArray:
    """Score ``sum_s w_s o_s / sigma_s^2`` (non-private steps weigh 1e6)."""
    scale = np.array([1e6 if s is None else 1.0 / s**2 for s in sigmas])
    return np.asarray(observations @ (weights * scale), dtype=np.float64)


def lower_bound(
    scores: FloatArray | Sequence[FloatArray],
    canary_in: BoolArray,
    delta: float,
    rng: np.random.Generator,
    confidence: float = 0.95,
    thresholds: int = 100,
) -> float:
    """Epsilon lower bound from the audit scores (one row per statistic).

    The statistic and threshold are chosen on one half of the trials and the bound
    is computed on the other half, so the Clopper-Pearson confidence holds.
    """
    stats = np.atleast_2d(np.asarray(scores, dtype=np.float64))
    t = np.asarray(canary_in, dtype=bool)
    if t.ndim != 1 or stats.shape[1] != t.size:
        raise ValueError(f"scores {stats.shape} and canary_in {t.shape} do not match")
    if not np.all(np.isfinite(stats)):
        raise ValueError("audit scores must be finite")
    order = rng.permutation(t.size)
    pick, test = order[: t.size // 2], order[t.size // 2 :]
    for part in (pick, test):
        if t[part].all() or not t[part].any():
            raise ValueError(
                "each half of the audit needs canary-in and canary-out trials"
            )

    def bound(part: npt.NDArray[np.int64], stat: int, threshold: float) -> float:
        guess = stats[stat, part] >= threshold
        pos, neg = t[part], ~t[part]
        tpr = float(guess[pos].mean())
        fpr = float(guess[neg].mean())
        return epsilon_lower_bound(
            tpr, fpr, delta, int(pos.sum()), int(neg.sum()), confidence
        )

    grid = np.linspace(0.0, 1.0, thresholds)
    candidates = [
        (k, float(c))
        for k in range(stats.shape[0])
        for c in np.unique(np.quantile(stats[k, pick], grid))
    ]
    stat, threshold = max(candidates, key=lambda kc: bound(pick, *kc))
    return bound(test, stat, threshold)


@dataclass(frozen=True)
class AuditResult:
    """An audit's empirical lower bound next to the epsilon the accountant claims."""

    eps_lower_bound: float
    eps_claimed: float

    @property
    def violated(self) -> bool:
        """Whether the mechanism provably leaks more than the accountant claims."""
        return self.eps_lower_bound > self.eps_claimed


def canary_audit(
    plans: Sequence[StepPlan],
    claimed: float,
    *,
    delta: float,
    n_records: int,
    trials: int,
    rng: np.random.Generator,
    sampling: Sampling = "poisson",
    claimed_rates: Sequence[float] | None = None,
) -> AuditResult:
    """Run a canary audit of a client that ran ``plans``.

    ``claimed_rates`` are the per-step rates the observer's test assumes (by
    default the rates the client ran); ``claimed`` is the accountant's epsilon.
    """
    if trials < 20:
        raise ValueError(f"trials must be >= 20, got {trials}")
    canary_in = rng.random(trials) < 0.5
    observations = observe_canary(plans, canary_in, n_records, sampling, rng)
    rates = (
        [p.rate for p in plans for _ in range(p.steps)]
        if claimed_rates is None
        else list(claimed_rates)
    )
    sigmas = [p.sigma for p in plans for _ in range(p.steps)]
    profile = inclusion_profile(plans, n_records, sampling, rng)
    scores = [
        likelihood_ratio(observations, rates, sigmas),
        matched_filter(observations, profile, sigmas),
    ]
    return AuditResult(lower_bound(scores, canary_in, delta, rng), claimed)
