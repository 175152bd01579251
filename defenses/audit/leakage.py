r"""Membership leakage of one attack's scores: ROC numbers and an epsilon bound.

:func:`membership_success` reports what :func:`defenses.metrics.membership_metrics`
reports (AUC, advantage, TPR at 1% and 0.1% FPR, on the tie-safe ROC) and the
empirical lower bound on the differential-privacy :math:`\varepsilon` (Jagielski et
al., 2020; Nasr et al., 2021), maximised over the ROC's thresholds:

.. math::

    \hat\varepsilon_{\text{lb}} = \max_t \varepsilon_{\text{lb}}\big(
    \underline{\mathrm{TPR}}_t, \overline{\mathrm{FPR}}_t, \delta\big),

where each threshold's rates are replaced by their Clopper-Pearson bounds
(:func:`defenses.metrics.epsilon_lower_bound` with the counts), so
:math:`\varepsilon \ge \hat\varepsilon_{\text{lb}}` holds with the given one-sided
confidence at the chosen threshold: the interval is
:math:`[\hat\varepsilon_{\text{lb}}, \infty)`. Picking the best of many thresholds
on the same candidates makes the bound optimistic, as in every audit that does so.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from scipy import stats

from defenses.arrays import FloatArray, IntArray
from defenses.metrics import epsilon_lower_bound, membership_metrics, roc


def _clopper_pearson_bounds(
    successes: IntArray, trials: int, confidence: float
) -> tuple[FloatArray, FloatArray]:
    """One-sided ``confidence`` lower and upper Clopper-Pearson bounds, vectorized."""
    tail = 1.0 - confidence
    k = successes.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        low = np.where(successes == 0, 0.0, stats.beta.ppf(tail, k, trials - k + 1))
        high = np.where(
            successes == trials, 1.0, stats.beta.ppf(1 - tail, k + 1, trials - k)
        )
    return np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)


def epsilon_bound(
    fprs: FloatArray,
    tprs: FloatArray,
    n_pos: int,
    n_neg: int,
    delta: float,
    confidence: float,
) -> float:
    """The largest Clopper-Pearson epsilon lower bound over the ROC's points.

    The best point is found on all points at once (the exact Clopper-Pearson bounds
    as beta quantiles); its bound is then computed by
    :func:`defenses.metrics.epsilon_lower_bound`, the value reported.
    """
    tp = np.rint(np.asarray(tprs) * n_pos).astype(np.int64)
    fp = np.rint(np.asarray(fprs) * n_neg).astype(np.int64)
    tpr_low, _ = _clopper_pearson_bounds(tp, n_pos, confidence)
    _, fpr_high = _clopper_pearson_bounds(fp, n_neg, confidence)
    with np.errstate(invalid="ignore", divide="ignore"):
        first = np.where(
            tpr_low - delta > 0,
            np.log(np.maximum(tpr_low - delta, 1e-300) / fpr_high),
            0.0,
        )
        second = np.where(
            1 - delta - fpr_high > 0,
            np.log(np.maximum(1 - delta - fpr_high, 1e-300) / (1 - tpr_low)),
            0.0,
        )
    best = int(np.argmax(np.maximum(first, second)))
    return epsilon_lower_bound(
        tp[best] / n_pos, fp[best] / n_neg, delta, n_pos, n_neg, confidence
    )


def membership_success(
    scores: npt.ArrayLike,
    truth: npt.ArrayLike,
    delta: float,
    confidence: float,
) -> tuple[dict[str, float], tuple[FloatArray, FloatArray]]:
    """Success metrics of membership scores and their ROC curve (FPR, TPR)."""
    bits = np.asarray(truth, dtype=bool)
    metrics = membership_metrics(scores, bits)
    fprs, tprs = roc(scores, bits)
    n_pos = int(bits.sum())
    metrics["eps_lb"] = epsilon_bound(
        fprs, tprs, n_pos, bits.size - n_pos, delta, confidence
    )
    return metrics, (fprs, tprs)
