"""The arms of an audit: the user's model as it is, and behind each defense.

A defense may be

* any suite :class:`~defenses.api.Defense` (a learner-to-learner wrapper: SSD's
  :class:`~defenses.ssd.arms.SSDDefense`, the reference pair's
  :class:`~defenses.reference.defense.Rounding` and
  :class:`~defenses.reference.defense.LabelOnly`, SSD's ART peers, ...). It wraps a
  learner whose ``fit`` returns the user's fitted model unchanged, so a
  post-processing defense builds on that model (SSD fits its class prototypes on the
  audit's validation records); a defense that trains from scratch is out of place in
  an audit of a fitted model;
* a :class:`~defenses.ssd.StealthyShield` (run as the matching ``SSDDefense``, so
  that its sampling seed follows the audit's seeds);
* an ART post-processor (``art.defences.postprocessor.Postprocessor``: ``Rounded``,
  ``ReverseSigmoid``, ``HighConfidence``, ``GaussianNoise``, ...), applied to the
  model's probabilities.

Every arm of one seed is built from the same fit stream
(:class:`numpy.random.SeedSequence`), exactly as :func:`defenses.harness.run_once`
builds them, so the arms' differences are paired.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from defenses.api import Defense
from defenses.arrays import FloatArray
from defenses.audit.records import AuditData
from defenses.audit.target import AuditedModel
from defenses.harness import label
from defenses.results import UNDEFENDED
from defenses.ssd import StealthyShield
from defenses.ssd.arms import SSDDefense


class Answering(Protocol):
    """A deployed system: what a query receives."""

    def predict_proba(self, X: FloatArray) -> FloatArray:
        """The answers to the flat rows ``X``."""
        ...


@dataclass(frozen=True, eq=False)
class FittedLearner:
    """A learner whose ``fit`` returns an already fitted model (and draws nothing)."""

    model: AuditedModel

    def fit(self, task: Any, rng: np.random.Generator) -> AuditedModel:
        """The fitted model, unchanged."""
        return self.model


@dataclass(frozen=True, eq=False)
class ARTPostProcessed:
    """The model's probabilities passed through an ART post-processor."""

    inner: AuditedModel
    post: Any

    def predict_proba(self, X: FloatArray) -> FloatArray:
        """Post-processed probabilities."""
        return np.asarray(self.post(self.inner.predict_proba(X)), dtype=np.float64)

    def clean_proba(self, X: FloatArray) -> FloatArray:
        """The undefended probabilities."""
        return self.inner.predict_proba(X)


@dataclass(frozen=True, eq=False)
class Arm:
    """One arm: its label, the defense object (None: undefended) and its builder."""

    label: str
    defense: Any | None
    build: Callable[[AuditedModel, AuditData, np.random.Generator], Answering]


def _is_art(obj: Any) -> bool:
    return callable(obj) and hasattr(obj, "apply_predict") and hasattr(obj, "params")


def _art_label(post: Any) -> str:
    params = ", ".join(f"{p}={getattr(post, p)!r}" for p in getattr(post, "params", []))
    return (
        f"art-{type(post).__name__}({params})"
        if params
        else f"art-{type(post).__name__}"
    )


def _suite(
    defense: Any,
) -> Callable[[AuditedModel, AuditData, np.random.Generator], Any]:
    def build(model: AuditedModel, data: AuditData, rng: np.random.Generator) -> Any:
        system = defense.wrap(FittedLearner(model)).fit(data, rng)
        if not hasattr(system, "predict_proba"):
            raise TypeError(
                f"defense {label(defense)!r} returned a system without predict_proba"
            )
        return system

    return build


def _undefended(model: AuditedModel, data: AuditData, rng: np.random.Generator) -> Any:
    return model


def make_arm(defense: Any | None) -> Arm:
    """The arm of one entry of ``defenses`` (None is the undefended arm)."""
    if defense is None:
        return Arm(UNDEFENDED, None, _undefended)
    if isinstance(defense, StealthyShield):
        defense = SSDDefense(
            epsilon=defense.epsilon,
            temperature=defense.temperature,
            seeding=defense.seeding,
            hash_resolution=defense.hash_resolution,
        )
    if isinstance(defense, Defense):
        return Arm(label(defense), defense, _suite(defense))
    if _is_art(defense):
        post = defense

        def build(
            model: AuditedModel, data: AuditData, rng: np.random.Generator
        ) -> Any:
            return ARTPostProcessed(model, post)

        return Arm(_art_label(defense), defense, build)
    raise TypeError(
        "defenses must hold suite Defenses (e.g. SSDDefense, Rounding, LabelOnly), "
        "StealthyShield or ART post-processors; got "
        f"{type(defense).__name__}"
    )


def make_arms(defenses: Sequence[Any]) -> list[Arm]:
    """The undefended arm first, then one arm per defense (labels must differ)."""
    if isinstance(defenses, str | bytes) or not isinstance(defenses, Sequence):
        raise TypeError("defenses must be a list of defenses")
    arms = [make_arm(None), *(make_arm(d) for d in defenses if d is not None)]
    labels = [arm.label for arm in arms]
    doubles = sorted({name for name in labels if labels.count(name) > 1})
    if doubles:
        raise ValueError(f"defenses holds the same arm twice: {doubles}")
    return arms
