"""The result record the CLI tests write: an attack's AUC and the model's accuracy."""

from defenses.results import Result
from defenses.testing import make_result


def auc_record(
    defense: str = "none",
    auc: float = 0.6,
    seed: int = 0,
    accuracy: float = 0.9,
    spec: str | None = None,
) -> Result:
    """A :func:`defenses.testing.make_result` with ``success.auc``,
    ``utility.accuracy`` and, given ``spec``, the spec it came from in ``meta``."""
    meta = {} if spec is None else {"spec": spec}
    return make_result(
        defense, seed, utility={"accuracy": accuracy}, success={"auc": auc}, meta=meta
    )
