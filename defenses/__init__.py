"""defense-suite: privacy and security defenses for machine-learning systems.

The shared interface lives here (threat models, protocols, oracle, cost accounting,
harness, results, metrics, data, registry, contract checks); each defense is a
subpackage (``defenses.ssd``, ``defenses.rps``, ``defenses.s3t``, ``defenses.civet``)
and two more live at the top level (``federated``, ``crypto``).
"""

from defenses.api import (
    Certifiable,
    Defense,
    DefenseKind,
    InferenceAttack,
    Learner,
    PoisoningAttack,
    Scenario,
)
from defenses.cost import count, phase, recording
from defenses.harness import evaluate, run_once
from defenses.oracle import QueryBudgetExceeded, QueryOracle
from defenses.registry import register
from defenses.results import Result, paired_deltas, read_jsonl, summarize, write_jsonl
from defenses.threat import (
    Budget,
    Capability,
    Goal,
    Knowledge,
    Stage,
    ThreatModel,
    ThreatModelViolation,
)

__all__ = [
    "Budget",
    "Capability",
    "Certifiable",
    "Defense",
    "DefenseKind",
    "Goal",
    "InferenceAttack",
    "Knowledge",
    "Learner",
    "PoisoningAttack",
    "QueryBudgetExceeded",
    "QueryOracle",
    "Result",
    "Scenario",
    "Stage",
    "ThreatModel",
    "ThreatModelViolation",
    "count",
    "evaluate",
    "paired_deltas",
    "phase",
    "read_jsonl",
    "recording",
    "register",
    "run_once",
    "summarize",
    "write_jsonl",
]
__version__ = "0.5.0"
