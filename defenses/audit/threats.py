"""Threat models an audit tests, in two words: what the adversary sees, how often.

:func:`threat_model` builds the :class:`~defenses.threat.ThreatModel` of a black-box
adversary of a deployed classifier; any other ``ThreatModel`` may be passed to
:func:`~defenses.audit.audit` instead. The audit enforces it as the benchmarks do:
an attack whose ``requires`` holds a capability the model does not grant is refused
by name, and every granted attack queries through a
:class:`~defenses.oracle.QueryOracle` built by
:meth:`~defenses.oracle.QueryOracle.granted_by` (labels only, and the budget).
"""

from __future__ import annotations

from typing import Literal

from defenses.checks import check_choice, check_int
from defenses.threat import Budget, Capability, Goal, ThreatModel

Access = Literal["scores", "labels"]
ACCESS: tuple[Access, ...] = ("scores", "labels")


def threat_model(
    access: Access = "scores",
    queries: int | None = None,
    aux_data: bool = True,
    adaptive: bool = False,
) -> ThreatModel:
    """A black-box adversary of a deployed classifier.

    Parameters
    ----------
    access : {"scores", "labels"}
        ``"scores"`` grants score vectors (and labels); ``"labels"`` the predicted
        label only.
    queries : int or None
        Inputs each attack may submit (None: unlimited).
    aux_data : bool
        Whether the adversary holds data of the same distribution (shadow models'
        training data, the inversion's public records).
    adaptive : bool
        Whether the adversary knows the defense and its parameters.
    """
    check_choice("access", access, ACCESS)
    if queries is not None:
        check_int("queries", queries, minimum=1)
        queries = int(queries)
    caps = {Capability.QUERY_LABEL}
    if access == "scores":
        caps.add(Capability.QUERY_SCORES)
    if aux_data:
        caps.add(Capability.AUX_DATA)
    return ThreatModel.granting(
        Goal.CONFIDENTIALITY,
        *caps,
        budget=Budget(queries=queries),
        adaptive=bool(adaptive),
    )


def describe(threat: ThreatModel) -> str:
    """The threat model in one sentence, for the top of a report."""
    if threat.grants(Capability.QUERY_SCORES):
        sees = "score vectors"
    elif threat.grants(Capability.QUERY_LABEL):
        sees = "predicted labels only"
    else:
        sees = "no query answers"
    budget = threat.budget.queries
    limit = (
        "unlimited queries"
        if budget is None
        else f"at most {budget} queries per attack"
    )
    aux = (
        "holds same-distribution auxiliary data"
        if threat.grants(Capability.AUX_DATA)
        else "holds no auxiliary data"
    )
    knows = "knows the defense" if threat.adaptive else "does not know the defense"
    return (
        f"{threat.knowledge.value} adversary at {threat.stage.value} "
        f"({threat.goal.value}): sees {sees}, {limit}, {aux}, {knows}."
    )
