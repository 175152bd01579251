r"""Exactness audits of unlearning, and the canary membership attack.

* **Twin test** (the definitive, bitwise check; research note §5.2). Train ``P`` on
  ``D`` and ``Q`` on ``D \ {x}`` with the same seeds; delete ``x`` from ``P`` and
  switch off ``x``'s slice in ``Q`` (the operator ``Deact_j``, which looks at the
  slice id only). Exact unlearning means every tensor the two hold is equal, bit for
  bit, and so are their outputs. As a power check, the switched-off stages of ``P``
  and ``Q`` must have differed (they saw different data).
* **Lineage audit.** No stored component (adapter group, stage head, shared buffer)
  was trained on a deleted id, the deleted rows are gone, and every served prefix is
  a prefix of a trained order.
* **Canary membership attack** (in the spirit of Carlini et al., 2019, "The Secret
  Sharer"; Yeom et al., 2018). An auditor plants mislabelled canaries, asks for their
  deletion, then scores each candidate by the log-odds of its planted label. Against
  never-trained canaries (the reference) the AUC is 0.5 when unlearning is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import torch

from defenses.arrays import FloatArray
from defenses.reference.attacks import LossThresholdAttack
from defenses.s3t.adapters import fingerprint
from defenses.s3t.defense import AllShardsDeadError, Unlearner
from defenses.threat import Capability


@dataclass(frozen=True)
class TwinReport:
    """Outcome of a twin test.

    Attributes
    ----------
    exact : bool
        Every held tensor and every output equal, bit for bit.
    tensors_equal, outputs_equal : bool
        The two halves of ``exact``.
    switched_off_differed : bool
        The stages switched off in both twins held different tensors (power check).
    n_tensors, n_switched_off : int
        Tensors compared, and tensors switched off in ``P``.
    mismatched : tuple of str
        Names of the tensors that differ (empty when exact).
    """

    exact: bool
    tensors_equal: bool
    outputs_equal: bool
    switched_off_differed: bool
    n_tensors: int
    n_switched_off: int
    mismatched: tuple[str, ...]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]


def _outputs(model: Unlearner, probe: FloatArray) -> FloatArray | None:
    try:
        return model.predict_proba(probe)
    except AllShardsDeadError:
        return None


def twin_test(
    factory: Callable[[], Unlearner],
    X: npt.ArrayLike,
    y: npt.ArrayLike,
    ids: npt.ArrayLike,
    target: object,
    probe: npt.ArrayLike | None = None,
) -> TwinReport:
    """Run the counterfactual twin test for deleting ``target``.

    ``factory`` builds an unfitted model; it is called twice, and both models must be
    configured identically (same backbone, seed and sizes).
    """
    features, labels, names = np.asarray(X), np.asarray(y), np.asarray(ids)
    keep = names != target
    if keep.all():
        raise ValueError(f"target {target!r} is not among the ids")
    p_model = factory().fit(features, labels, names)
    q_model = factory().fit(features[keep], labels[keep], names[keep])
    p_before, q_before = p_model.active_state(), q_model.active_state()
    slots = p_model.locate(names[~keep])
    p_model.delete(names[~keep])
    q_model.deactivate(slots)
    p_after, q_after = p_model.active_state(), q_model.active_state()
    mismatched = _equal(p_after, q_after)
    gone = sorted(set(p_before) - set(p_after))
    differed = bool(
        _equal({n: p_before[n] for n in gone}, {n: q_before[n] for n in gone})
    )
    points = features if probe is None else np.asarray(probe)
    p_out, q_out = _outputs(p_model, points), _outputs(q_model, points)
    outputs_equal = (p_out is None and q_out is None) or (
        p_out is not None and q_out is not None and np.array_equal(p_out, q_out)
    )
    return TwinReport(
        exact=not mismatched and outputs_equal,
        tensors_equal=not mismatched,
        outputs_equal=outputs_equal,
        switched_off_differed=differed,
        n_tensors=len(p_after),
        n_switched_off=len(gone),
        mismatched=tuple(mismatched),
    )


@dataclass(frozen=True)
class LineageReport:
    """Outcome of a lineage audit: ``clean`` when all three checks pass."""

    clean: bool
    offenders: tuple[str, ...]
    rows_erased: bool
    served_valid: bool
    backbone_intact: bool


def lineage_audit(model: Unlearner, deleted: Iterable[object]) -> LineageReport:
    """Check that no stored component or row depends on a ``deleted`` id.

    Four checks, all required for ``clean``: no stored stage's lineage holds a
    deleted id (``offenders``), no training row holds one (``rows_erased``), every
    served prefix is a prefix of a configured order (``served_valid``), and the
    frozen backbone's fingerprint (SHA-256 of its parameters and buffers) equals the
    one recorded at fit (``backbone_intact``): a backbone that moved was written by
    training on data the records do not attribute.
    """
    gone = frozenset(deleted)
    offenders = tuple(name for name, seen in model.lineage().items() if seen & gone)
    rows_erased = not (model.training_ids() & gone)
    served_valid = all(
        any(order[: len(p)] == p for order in model.orders) for p in model.served()
    )
    intact = fingerprint(model.backbone) == model.fingerprint
    return LineageReport(
        clean=not offenders and rows_erased and served_valid and intact,
        offenders=offenders,
        rows_erased=rows_erased,
        served_valid=served_valid,
        backbone_intact=intact,
    )


@dataclass(frozen=True)
class CanaryAttack(LossThresholdAttack):
    """Score each canary by the log-odds of its planted (wrong) label.

    The loss attack (:class:`~defenses.reference.attacks.LossThresholdAttack`) with
    the planted labels as the candidates' ``labels``; it needs deletion requests.

    Parameters
    ----------
    floor : float
        Probabilities are clipped to [floor, 1 - floor], in [1e-15, 0.5).
    """

    name: ClassVar[str] = "s3t-canary-mia"
    requires: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.QUERY_SCORES, Capability.REQUEST_DELETION}
    )
    floor: float = 1e-12
