r"""Peers and ablations of SSD, as harness post-processing defenses.

Peers (IBM ART, ``adversarial-robustness-toolbox``, ``art.defences.postprocessor``),
run from the library itself:

* ``ReverseSigmoid(beta, gamma)`` (Lee et al., 2018), ``Rounded(decimals)``,
  ``HighConfidence(cutoff)`` (not renormalised) and ``ClassLabels`` keep the arg-max,
  so they cannot affect a label-only attack.
* ``GaussianNoise(scale)`` is the only one that randomizes labels. ART draws its noise
  from numpy's global generator; :func:`gaussian_noise` applies the same rule with a
  seeded :class:`numpy.random.Generator` (the tests check it against ART's output
  for the same noise), so the benchmark stays reproducible.
* ART 1.20's ``ClassLabels`` marks whole columns on a mixed batch (open PR #2824), so
  it is applied to each group of rows sharing an arg-max, where it is correct.

Ablations of the paper (Fig. 4):

* :class:`SSDNoTemperature`: the pseudo-label is drawn from :math:`f` itself
  ("w/o T", the intuitive idea the paper rejects).
* :class:`SSDConstantBudget`: a constant L1 budget instead of :math:`\varepsilon H(f)`
  ("w/o adaptive").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from defenses.api import DefenseKind, Learner
from defenses.arrays import FloatArray
from defenses.checks import check_int
from defenses.ssd.arms import (
    Deployed,
    HasValidation,
    PostProcessedLearner,
    PostProcessor,
    SSDDefense,
    check_number,
)
from defenses.ssd.defense import StealthyShield


@functools.cache
def _art() -> Any:
    """The ART post-processor module (imported lazily: importing ART takes seconds)."""
    from art.defences import postprocessor

    return postprocessor


def gaussian_noise(probs: FloatArray, noise: FloatArray) -> FloatArray:
    """ART's ``GaussianNoise`` rule with given noise.

    Add ``noise``; if every input row is a probability vector (and K > 1), zero the
    negative entries and renormalise each row; with K = 1, zero the negatives only.
    One deviation: ART divides by zero when every entry of a row turns negative (a NaN
    row); here such a row becomes uniform.
    """
    out = probs + noise
    k = probs.shape[1]
    rows_ok = np.all((probs >= 0) & (probs <= 1), axis=1) & np.isclose(
        probs.sum(axis=1), 1.0
    )
    if k > 1 and bool(np.all(rows_ok)):
        out[out < 0.0] = 0.0
        sums = out.sum(axis=1, keepdims=True)
        empty = sums[:, 0] <= 0.0
        out[empty] = 1.0 / k
        sums[empty] = 1.0
        out /= sums
    elif k == 1:
        out[out < 0.0] = 0.0
    return out


def class_labels(probs: FloatArray) -> FloatArray:
    """ART's ``ClassLabels`` (one-hot arg-max), applied per arg-max group of rows."""
    out = np.zeros_like(probs)
    top = np.argmax(probs, axis=1)
    post = _art().ClassLabels()
    for label in np.unique(top):
        rows = top == label
        out[rows] = post(probs[rows])
    return out


@dataclass(frozen=True, eq=False)
class _ArtCall:
    """A post-processor calling an ART instance on the probabilities."""

    post: Any

    def __call__(self, probs: FloatArray, inputs: FloatArray) -> FloatArray:
        return np.asarray(
            self.post(np.asarray(probs, dtype=np.float64)), dtype=np.float64
        )


@dataclass(frozen=True, eq=False)
class _NoiseCall:
    """Seeded Gaussian noise with ART's semantics."""

    scale: float
    rng: np.random.Generator

    def __call__(self, probs: FloatArray, inputs: FloatArray) -> FloatArray:
        noise = self.rng.normal(0.0, self.scale, size=probs.shape)
        return gaussian_noise(np.asarray(probs, dtype=np.float64), noise)


@dataclass(frozen=True, eq=False)
class _LabelsCall:
    def __call__(self, probs: FloatArray, inputs: FloatArray) -> FloatArray:
        return class_labels(np.asarray(probs, dtype=np.float64))


class _PostProcessorDefense:
    """Shared ``kind`` and ``wrap`` of the peer defenses."""

    kind: ClassVar[DefenseKind] = DefenseKind.POSTPROCESSOR

    def wrap(self, learner: Learner[Any, Deployed]) -> PostProcessedLearner:
        """Return the learner whose fitted system answers through this peer."""
        factory: Any = self
        return PostProcessedLearner(learner, factory)


@dataclass(frozen=True)
class _ArtPeer(_PostProcessorDefense):
    """A peer that is ART's post-processor ``art_class``, built from this arm's fields.

    The arm's dataclass fields are the keyword arguments of the ART constructor, so
    the harness records the library's own parameters.
    """

    art_class: ClassVar[str]

    def build(
        self, system: Deployed, task: HasValidation, rng: np.random.Generator
    ) -> PostProcessor:
        """ART's ``art_class`` with this arm's fields as arguments."""
        return _ArtCall(getattr(_art(), self.art_class)(**dataclasses.asdict(self)))


@dataclass(frozen=True)
class ARTReverseSigmoid(_ArtPeer):
    """ART ``ReverseSigmoid(beta, gamma)``: confidence perturbation, arg-max kept.

    Parameters
    ----------
    beta : float
        Perturbation magnitude, in (0, 10].
    gamma : float
        Perturbation slope, in (0, 10].
    """

    name: ClassVar[str] = "ssd-art-reverse-sigmoid"
    art_class: ClassVar[str] = "ReverseSigmoid"
    beta: float = 1.0
    gamma: float = 0.1

    def __post_init__(self) -> None:
        check_number(type(self).__name__, "beta", self.beta, 1e-9, 10.0)
        check_number(type(self).__name__, "gamma", self.gamma, 1e-9, 10.0)


@dataclass(frozen=True)
class ARTGaussianNoise(_PostProcessorDefense):
    """ART ``GaussianNoise(scale)``, seeded: the only ART peer that changes labels.

    Parameters
    ----------
    scale : float
        Noise standard deviation, in (0, 10].
    """

    name: ClassVar[str] = "ssd-art-gaussian-noise"
    scale: float = 0.2

    def __post_init__(self) -> None:
        check_number(type(self).__name__, "scale", self.scale, 1e-9, 10.0)

    def build(
        self, system: Deployed, task: HasValidation, rng: np.random.Generator
    ) -> PostProcessor:
        """Gaussian noise drawn from a generator seeded by ``rng``."""
        return _NoiseCall(self.scale, np.random.default_rng(int(rng.integers(2**62))))


@dataclass(frozen=True)
class ARTRounded(_ArtPeer):
    """ART ``Rounded(decimals)``.

    Parameters
    ----------
    decimals : int
        Decimal places kept, in [0, 16].
    """

    name: ClassVar[str] = "ssd-art-rounded"
    art_class: ClassVar[str] = "Rounded"
    decimals: int = 3

    def __post_init__(self) -> None:
        check_int(f"{type(self).__name__}.decimals", self.decimals, 0, 16)


@dataclass(frozen=True)
class ARTHighConfidence(_ArtPeer):
    """ART ``HighConfidence(cutoff)``: zero the scores below ``cutoff``.

    Parameters
    ----------
    cutoff : float
        Threshold, in [0, 1].
    """

    name: ClassVar[str] = "ssd-art-high-confidence"
    art_class: ClassVar[str] = "HighConfidence"
    cutoff: float = 0.25

    def __post_init__(self) -> None:
        check_number(type(self).__name__, "cutoff", self.cutoff, 0.0, 1.0)


@dataclass(frozen=True)
class ARTClassLabels(_PostProcessorDefense):
    """ART ``ClassLabels``: answer the one-hot arg-max only."""

    name: ClassVar[str] = "ssd-art-class-labels"

    def build(
        self, system: Deployed, task: HasValidation, rng: np.random.Generator
    ) -> PostProcessor:
        """ART's ClassLabels, applied per arg-max group."""
        return _LabelsCall()


class NoTemperatureShield(StealthyShield):
    """SSD with the pseudo-label drawn from ``f`` itself (no temperature)."""

    draws_from_probs = True


class ConstantBudgetShield(StealthyShield):
    """SSD with the constant budget ``epsilon`` instead of ``epsilon * H(f)``."""

    constant_budget = True


@dataclass(frozen=True)
class SSDNoTemperature(SSDDefense):
    """Ablation "w/o T": SSD sampling its pseudo-label from ``f``."""

    name: ClassVar[str] = "ssd-no-temperature"
    shield_class: ClassVar[type[StealthyShield]] = NoTemperatureShield


@dataclass(frozen=True)
class SSDConstantBudget(SSDDefense):
    """Ablation "w/o adaptive": SSD with the constant L1 budget ``epsilon``."""

    name: ClassVar[str] = "ssd-constant-budget"
    shield_class: ClassVar[type[StealthyShield]] = ConstantBudgetShield
    epsilon: float = 0.1


BASELINES = (
    SSDNoTemperature,
    SSDConstantBudget,
    ARTReverseSigmoid,
    ARTGaussianNoise,
    ARTRounded,
    ARTHighConfidence,
    ARTClassLabels,
)
"""The ablations and peers (registered next to SSD by :mod:`defenses.ssd.scenario`)."""
