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

from defenses.metrics import epsilon_lower_bound, membership_metrics, roc

FloatArray = npt.NDArray[np.float64]


def epsilon_bound(
    fprs: FloatArray,
    tprs: FloatArray,
    n_pos: int,
    n_neg: int,
    delta: float,
    confidence: float,
) -> float:
    """The largest Clopper-Pearson epsilon lower bound over the ROC's points."""
    points = sorted(
        {(round(t * n_pos), round(f * n_neg)) for f, t in zip(fprs, tprs, strict=True)}
    )
    best = 0.0
    for tp, fp in points:
        bound = epsilon_lower_bound(
            tp / n_pos, fp / n_neg, delta, n_pos, n_neg, confidence
        )
        best = max(best, bound)
    return best


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
