"""What a spec's loader function returns: the fitted model and its records.

A spec (:mod:`defenses.audit.spec`) names a ``module:function``; the function is
imported and called (nothing is unpickled from a file) and returns
:class:`AuditInputs`, whose fields are the arguments of
:func:`~defenses.audit.audit` that come with the model rather than with the spec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from defenses.audit.records import Records
from defenses.audit.target import OUTPUTS, Outputs
from defenses.checks import check_choice


@dataclass(frozen=True, eq=False)
class AuditInputs:
    """A fitted model with its members and non-members (see :func:`audit`).

    Attributes
    ----------
    model : torch.nn.Module, object with ``predict_proba``, or callable
        The fitted classifier.
    members, non_members : (X, y) or Dataset
        Records it was and was not trained on.
    test, validation : (X, y) or Dataset, optional
        Utility records and the records post-processing defenses are fitted on.
    public : array, optional
        The inversion adversary's unlabelled data.
    build_model : callable, optional
        ``build_model(seed)``: an untrained model of the same architecture (shadows).
    input_shape : sequence of int, optional
        Shape of one record as the model takes it.
    outputs : {"auto", "probs", "logits"}
        What the model returns.
    private_class : label or sequence of labels, optional
        The default private classes (a spec's ``private_class`` overrides it).
    """

    model: Any
    members: Records
    non_members: Records
    test: Records | None = None
    validation: Records | None = None
    public: npt.ArrayLike | None = None
    build_model: Callable[[int], Any] | None = None
    input_shape: Sequence[int] | None = None
    outputs: Outputs = "auto"
    private_class: Any = None

    def __post_init__(self) -> None:
        check_choice("AuditInputs.outputs", self.outputs, OUTPUTS)
        if self.build_model is not None and not callable(self.build_model):
            raise TypeError("AuditInputs.build_model must be callable")
