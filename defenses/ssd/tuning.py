r"""Choosing SSD's ``epsilon`` for an accuracy budget, on the owner's validation data.

SSD has no top-1 constraint: an answer's arg-max flips whenever the pseudo-label
differs from it and the budget :math:`\varepsilon H(f)` allows, so a model whose
outputs are uncertain on real inputs (a random forest's averaged votes) loses test
accuracy where a confident one (a logistic regression on easy data) loses none.
:func:`choose_epsilon` picks the largest candidate :math:`\varepsilon` whose accuracy
cost is provably at most a target :math:`t` on data like the validation data.

The math. The validation rows are split (stratified, seeded) into a *fit* part,
on which the shield's prototypes and key are fitted, and a *check* part of
:math:`n` rows, independent of the fitted shield. For a candidate :math:`\varepsilon`
let :math:`h` be the number of check rows the undefended model gets right and the
defended answer gets wrong (its *harms*). The accuracy drop on fresh data,
:math:`\Delta = \mathrm{acc}(f) - \mathrm{acc}(\mathrm{SSD}_\varepsilon \circ f)`, is
at most the harm rate :math:`\rho = P(\text{right} \to \text{wrong})` (rows turned
right only lower it), and :math:`h \sim \mathrm{Binomial}(n, \rho)` given the fitted
shield, so the Clopper-Pearson bound

.. math::

    \bar\rho(h) = \mathrm{BetaPPF}(1 - \delta;\; h + 1,\; n - h)

exceeds :math:`\rho` with probability at most :math:`\delta`. Candidates are tested
in increasing order (fixed-sequence testing): :math:`\varepsilon_j` is accepted while
:math:`\bar\rho_k \le t` for every :math:`k \le j`, and the search stops at the
first failure. Fixed-sequence testing needs no multiplicity correction, so

.. math::

    P\big(\Delta(\hat\varepsilon) > t\big) \le \delta ,

for the returned shield, over the draw of the check rows (and of the random
pseudo-labels under ``seeding="random"``). Under ``seeding="input-hash"`` a row's
answer is a function of what is hashed: pass the ``inputs`` that deployment hashes
(the queries), so the check sees the answers deployment gives.

:func:`protect_within_budget` does it for a fitted scikit-learn classifier (labels
of any type, the queries hashed as deployment hashes them) and returns the
deployed :class:`~defenses.ssd.sklearn.ShieldedClassifier`.

If even the smallest candidate's bound is above :math:`t` (too few check rows:
with no harm at all, :math:`\bar\rho(0) = 1 - \delta^{1/n}`, about
:math:`3 / n` at :math:`\delta = 0.05`), the search refuses with the number of rows
it would need.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse
from scipy import stats
from sklearn.model_selection import train_test_split

from defenses.checks import check_choice, check_fraction, check_int, check_real
from defenses.ssd.batch import as_rows
from defenses.ssd.defense import StealthyShield
from defenses.ssd.seeding import SEEDINGS, Seeding
from defenses.ssd.sklearn import ShieldedClassifier
from defenses.targets import check_labels

logger = logging.getLogger(__name__)

CANDIDATES: tuple[float, ...] = (
    0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5,
    2.0, 3.0, 4.0, 8.0,
)  # fmt: skip
"""Default candidates: the paper's 0.35-1.5 and a wide margin on both sides."""


@dataclass(frozen=True)
class EpsilonSearch:
    r"""Settings of :func:`choose_epsilon`.

    Parameters
    ----------
    max_accuracy_drop : float
        Target :math:`t` in (0, 1): the accuracy the owner accepts to lose.
    confidence : float
        :math:`1 - \delta` in (0, 1): probability that the chosen epsilon meets the
        target.
    candidates : tuple of float
        Epsilons tried, positive, strictly increasing (the fixed sequence).
    check_size : float
        Share of the validation rows held out to check the cost, in (0, 1); the
        rest fits the prototypes.
    random_state : int
        Seed of the stratified split of the validation rows (not of the shield's
        key, which comes from the shield's own ``seed``).
    """

    max_accuracy_drop: float = 0.01
    confidence: float = 0.95
    candidates: tuple[float, ...] = CANDIDATES
    check_size: float = 0.5
    random_state: int = 0

    def __post_init__(self) -> None:
        for name in ("max_accuracy_drop", "confidence", "check_size"):
            check_fraction(name, getattr(self, name))
        check_int("random_state", self.random_state, 0, 2**32 - 1)
        values = tuple(self.candidates)
        if not values:
            raise ValueError("candidates must hold at least one epsilon, got ()")
        for i, value in enumerate(values):
            check_real(f"candidates[{i}]", value, 0.0, open_low=True)
        if any(b <= a for a, b in itertools.pairwise(values)):
            raise ValueError(
                f"candidates must be strictly increasing (the order of the fixed "
                f"sequence), got {values}"
            )


@dataclass(frozen=True)
class EpsilonChoice:
    """The chosen epsilon, its fitted shield and the evidence for it.

    Attributes
    ----------
    epsilon : float
        The largest candidate that met the target.
    shield : StealthyShield
        Fitted on the fit rows with ``epsilon`` (the shield the bound is about).
    tried : tuple of float
        The candidates examined, in order (up to the first failure).
    harm_rates, drops, bounds : tuple of float
        Per candidate tried, on the check rows: the share of rows turned from right
        to wrong, the net accuracy drop, and the upper confidence bound on the harm
        rate.
    n_check : int
        Number of check rows.
    """

    epsilon: float
    shield: StealthyShield
    tried: tuple[float, ...]
    harm_rates: tuple[float, ...]
    drops: tuple[float, ...]
    bounds: tuple[float, ...]
    n_check: int


def harm_bound(harms: int, n: int, confidence: float) -> float:
    """Clopper-Pearson upper bound on a rate after ``harms`` of ``n`` rows."""
    if harms >= n:
        return 1.0
    return float(stats.beta.ppf(confidence, harms + 1, n - harms))


def rows_needed(target: float, confidence: float) -> int:
    """Check rows for which zero harms bound the rate at ``target``."""
    return math.ceil(math.log(1.0 - confidence) / math.log(1.0 - target))


def _rows_of(inputs: Any, rows: npt.NDArray[np.intp]) -> Any:
    if inputs is None:
        return None
    if hasattr(inputs, "iloc"):
        return inputs.iloc[rows]
    if scipy.sparse.issparse(inputs):
        return scipy.sparse.csr_matrix(inputs)[rows]
    return np.asarray(inputs)[rows]


def choose_epsilon(
    val_probs: npt.ArrayLike,
    val_labels: npt.ArrayLike,
    search: EpsilonSearch | None = None,
    *,
    shield: StealthyShield | None = None,
    inputs: Any = None,
) -> EpsilonChoice:
    r"""The largest epsilon whose accuracy cost is at most the target, w.p. 1 - delta.

    Parameters
    ----------
    val_probs : array of shape (N, K)
        The undefended model's probabilities on validation rows (held out from its
        training data).
    val_labels : int array of shape (N,)
        True labels in ``[0, K)`` (for a scikit-learn model with other labels,
        ``np.searchsorted(model.classes_, y)``).
    search : EpsilonSearch or None
        Target, confidence, candidates and split (None: the defaults, a target of
        one point of accuracy at 95 % confidence).
    shield : StealthyShield or None
        Template of the other settings (temperature, seeding, seed, ...); copied,
        never changed. None: ``StealthyShield(seeding="input-hash")``.
    inputs : array, DataFrame, sparse matrix or None
        The validation queries, one per row, hashed under ``seeding="input-hash"``
        as deployment hashes them (None: the probabilities are hashed).

    Returns
    -------
    EpsilonChoice
        The epsilon, its shield (fitted on the fit rows) and the evidence.

    Raises
    ------
    ValueError
        Bad shapes or labels, or no candidate meets the target (the message says
        how many check rows the target needs).
    """
    settings = EpsilonSearch() if search is None else search
    template = StealthyShield(seeding="input-hash") if shield is None else shield
    if not isinstance(template, StealthyShield):
        raise TypeError(f"shield must be a StealthyShield, got {type(template)}")
    rows, _ = as_rows(val_probs, "val_probs")
    probs = np.asarray(rows, dtype=np.float64)
    labels = np.asarray(val_labels)
    if probs.ndim != 2 or probs.shape[0] < 2 or labels.shape != (probs.shape[0],):
        raise ValueError(
            f"val_probs must be (N, K) with N >= 2 and val_labels (N,), got "
            f"{probs.shape} and {labels.shape}"
        )
    counts = np.unique(labels, return_counts=True)[1]
    stratify = labels if counts.min() >= 2 else None
    fit_rows, check_rows = train_test_split(
        np.arange(labels.size),
        test_size=settings.check_size,
        stratify=stratify,
        random_state=settings.random_state,
    )
    fitted = copy.deepcopy(template).fit(probs[fit_rows], labels[fit_rows])
    f, y = probs[check_rows], labels[check_rows]
    queries = _rows_of(inputs, check_rows)
    right = f.argmax(axis=1) == y
    n = int(y.size)
    tried: list[float] = []
    harm_rates: list[float] = []
    drops: list[float] = []
    bounds: list[float] = []
    chosen: StealthyShield | None = None
    for epsilon in settings.candidates:
        candidate = copy.deepcopy(fitted).set_params(epsilon=epsilon)
        defended = np.asarray(candidate(f, inputs=queries)).argmax(axis=1) == y
        harms = int(np.count_nonzero(right & ~defended))
        bound = harm_bound(harms, n, settings.confidence)
        tried.append(float(epsilon))
        harm_rates.append(harms / n)
        drops.append(float(right.mean() - defended.mean()))
        bounds.append(bound)
        logger.info(
            "epsilon %g: %d of %d check rows harmed, bound %.4f",
            epsilon,
            harms,
            n,
            bound,
        )
        if bound > settings.max_accuracy_drop:
            break
        chosen = candidate
    if chosen is None:
        need = rows_needed(settings.max_accuracy_drop, settings.confidence)
        raise ValueError(
            f"no epsilon meets max_accuracy_drop={settings.max_accuracy_drop:g} at "
            f"confidence={settings.confidence:g}: the smallest candidate "
            f"{tried[0]:g} harmed {harm_rates[0] * n:.0f} of {n} check rows (bound "
            f"{bounds[0]:.4f}); even with no harm the bound needs at least {need} "
            "check rows: give more validation rows, a larger max_accuracy_drop or "
            "smaller candidates"
        )
    return EpsilonChoice(
        epsilon=float(chosen.epsilon),
        shield=chosen,
        tried=tuple(tried),
        harm_rates=tuple(harm_rates),
        drops=tuple(drops),
        bounds=tuple(bounds),
        n_check=n,
    )


def protect_within_budget(
    estimator: Any,
    X_val: Any,
    y_val: Any,
    search: EpsilonSearch | None = None,
    *,
    shield: StealthyShield | None = None,
    seeding: Seeding = "input-hash",
) -> tuple[ShieldedClassifier, EpsilonChoice]:
    """A fitted classifier shielded with the largest epsilon within the budget.

    Parameters
    ----------
    estimator : fitted classifier with ``predict_proba`` and ``classes_``
        The deployed model (used as it is).
    X_val, y_val : validation rows and labels
        Held out from the model's training data; labels of any type in
        ``estimator.classes_``. ``X_val`` reaches the model untouched and is
        hashed as deployment hashes queries.
    search : EpsilonSearch or None
        Target and confidence (see :func:`choose_epsilon`).
    shield : StealthyShield or None
        Template of the shield's other settings (None: the defaults).
    seeding : {"input-hash", "random"}
        The deployed answers' seeding (default: same input, same answer).

    Returns
    -------
    (ShieldedClassifier, EpsilonChoice)
        The fitted wrapper (``predict`` / ``predict_proba``) and the evidence.
    """
    check_choice("seeding", seeding, SEEDINGS)
    labels = check_labels(y_val, "protect_within_budget")
    classes = getattr(estimator, "classes_", None)
    if classes is None or not callable(getattr(estimator, "predict_proba", None)):
        raise TypeError(
            "estimator must be a fitted classifier with predict_proba and classes_, "
            f"got {type(estimator).__name__}"
        )
    positions = {label: i for i, label in enumerate(np.asarray(classes).tolist())}
    unknown = sorted({v for v in labels.tolist() if v not in positions}, key=str)
    if unknown:
        raise ValueError(f"y_val has labels the estimator does not know: {unknown}")
    codes = np.array([positions[v] for v in labels.tolist()], dtype=np.int64)
    template = StealthyShield() if shield is None else shield
    if not isinstance(template, StealthyShield):
        raise TypeError(f"shield must be a StealthyShield, got {type(template)}")
    template = copy.deepcopy(template)
    template.set_params(seeding=seeding)
    choice = choose_epsilon(
        estimator.predict_proba(X_val), codes, search, shield=template, inputs=X_val
    )
    wrapped = ShieldedClassifier.prefitted(estimator, choice.shield, seeding=seeding)
    return wrapped, choice
