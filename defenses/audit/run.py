"""The audit's entry point: check the user's model and records, then play the game.

:func:`audit` turns what the user hands over (a fitted model, records as ``(X, y)``
pairs or :class:`~defenses.data.Dataset`, a threat model, defenses) into a checked
:class:`~defenses.audit.game.AuditJob` and runs it
(:func:`~defenses.audit.game.run_audit`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.audit.arms import make_arms
from defenses.audit.config import AuditConfig
from defenses.audit.game import AuditJob, run_audit
from defenses.audit.inversion import public_records
from defenses.audit.preflight import (
    carve_validation,
    degenerate_answers,
    degenerate_inputs,
    warn_all,
)
from defenses.audit.records import (
    AuditData,
    Records,
    private_classes,
    to_dataset,
    with_classes,
)
from defenses.audit.report import AuditReport
from defenses.audit.target import Outputs, as_audited
from defenses.audit.threats import threat_model
from defenses.checks import check_real
from defenses.threat import ThreatModel


def _records(
    job_name: str, records: Records | None, classes: Any, n_features: int
) -> Any:
    if records is None:
        return None
    data, _ = to_dataset(job_name, records, classes)
    if data.X.shape[1] != n_features:
        raise ValueError(
            f"{job_name} records have {data.X.shape[1]} features, members {n_features}"
        )
    return data


def _check_bounds(bounds: Any) -> tuple[float, float] | str | None:
    """``"data"``, None, or a finite ``(low, high)`` with low < high."""
    if bounds is None or (isinstance(bounds, str) and bounds == "data"):
        return bounds
    if not isinstance(bounds, tuple | list) or len(bounds) != 2:
        raise TypeError(f"bounds must be (low, high), None or 'data', got {bounds!r}")
    low = check_real("bounds[0]", bounds[0])
    high = check_real("bounds[1]", bounds[1])
    if not low < high:
        raise ValueError(f"bounds must have low < high, got {bounds!r}")
    return (low, high)


def audit(
    model: Any,
    members: Records,
    non_members: Records,
    *,
    threat: ThreatModel | None = None,
    defenses: Sequence[Any] = (),
    private_class: Any = None,
    test: Records | None = None,
    validation: Records | None = None,
    public: npt.ArrayLike | None = None,
    build_model: Callable[[int], Any] | None = None,
    input_shape: Sequence[int] | None = None,
    outputs: Outputs = "auto",
    bounds: tuple[float, float] | str | None = "data",
    config: AuditConfig | None = None,
    name: str | None = None,
) -> AuditReport:
    """Attack a fitted classifier, undefended and behind each defense.

    Parameters
    ----------
    model : torch.nn.Module, object with ``predict_proba``, or callable
        The fitted classifier (see :func:`~defenses.audit.target.as_audited`).
    members, non_members : (X, y) or Dataset
        Records the model was trained on, and records it was not.
    threat : ThreatModel, optional
        What the adversary may do (default :func:`~defenses.audit.threat_model`:
        scores, unlimited queries, auxiliary data).
    defenses : sequence
        Defenses to compare (suite Defenses, StealthyShield, ART post-processors).
    private_class : label or sequence of labels, optional
        Classes to invert; None skips model inversion.
    test, validation : (X, y) or Dataset, optional
        Utility records (default: the non-members) and the records post-processing
        defenses are fitted on. Without ``validation``, a quarter of each class of
        the test records (or, without ``test``, of the non-members) is held out
        for it (:func:`~defenses.audit.preflight.carve_validation`), so no defense
        is fitted on the records the audit evaluates.
    public : array, optional
        The inversion adversary's unlabelled data (default: the non-members outside
        the private classes).
    build_model : callable, optional
        ``build_model(seed)`` returns an untrained model for the LiRA shadows
        (see :mod:`defenses.audit.shadows`); None skips LiRA.
    input_shape : sequence of int, optional
        Shape of one record as the model takes it (default: the members' shape).
    outputs : {"auto", "probs", "logits"}
        What the model returns.
    bounds : (float, float), None or "data"
        Box of the inversion's reconstructions ("data": the records' range).
    config : AuditConfig, optional
        Seeds, shadow settings, attack strengths.
    name : str, optional
        Name of the audit (the report's title and the results' scenario); default
        the model's class name (``RandomForestClassifier``), so the title reads
        ``# Privacy audit: RandomForestClassifier``.

    Returns
    -------
    AuditReport

    Warns
    -----
    AuditInputWarning
        For inputs that make the numbers unreliable (few records, members equal to
        non-members, a single class, validation records that are evaluated) and for
        answers that do (the same for every record, or independent of the labels);
        the report lists them too.
    """
    bounds = _check_bounds(bounds)
    config = AuditConfig() if config is None else config
    if not isinstance(config, AuditConfig):
        raise TypeError("config must be an AuditConfig")
    threat = threat_model() if threat is None else threat
    if not isinstance(threat, ThreatModel):
        raise TypeError("threat must be a defenses.threat.ThreatModel")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty string or None, got {name!r}")
    if build_model is not None and not callable(build_model):
        raise TypeError("build_model must be callable: build_model(seed) -> model")
    raw_classes = getattr(model, "classes_", None)
    classes = None if raw_classes is None else np.asarray(raw_classes)
    mem, shape = to_dataset("members", members, classes)
    if input_shape is not None:
        shape = tuple(int(s) for s in input_shape)
        if int(np.prod(shape)) != mem.X.shape[1]:
            raise ValueError(
                f"input_shape {shape} does not hold the members' "
                f"{mem.X.shape[1]} features"
            )
    target = as_audited(model, shape, outputs)
    if name is None:
        name = target.name.removeprefix("model (").removesuffix(")")
    try:
        n_classes = int(target.predict_proba(mem.X[:1]).shape[1])
    except (TypeError, ValueError) as error:
        raise ValueError(f"model could not answer the members: {error}") from error
    split = carve_validation(
        _records("non_members", non_members, classes, mem.X.shape[1]),
        _records("test", test, classes, mem.X.shape[1]),
        _records("validation", validation, classes, mem.X.shape[1]),
    )
    data = AuditData(
        members=with_classes(mem, n_classes),
        non_members=with_classes(split.non_members, n_classes),
        test=with_classes(split.test, n_classes),
        val=with_classes(split.val, n_classes),
        input_shape=shape,
        n_classes=n_classes,
    )
    reasons = degenerate_inputs(data.members, data.non_members, data.test, data.val)
    reasons += degenerate_answers(
        target.predict_proba, [data.members, data.non_members]
    )
    warn_all(reasons)
    private = (
        None
        if private_class is None
        else private_classes("private_class", private_class, classes, n_classes)
    )
    if private is not None and not np.all(np.isin(private, mem.y)):
        raise ValueError(
            f"private_class {private_class!r}: every private class needs members "
            "(the judge's reference records)"
        )
    public_x = (
        None
        if private is None
        else public_records(
            data.non_members,
            private,
            None if public is None else np.asarray(public, dtype=np.float64),
        )
    )
    box = data.bounds() if isinstance(bounds, str) else bounds
    job = AuditJob(
        name,
        target,
        data,
        threat,
        config,
        make_arms(list(defenses)),
        private,
        public_x,
        box,
        build_model,
        outputs,
        tuple(reasons),
        split.source,
    )
    return run_audit(job)
