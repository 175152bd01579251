import numpy as np
import pytest

from defenses.cost import recording
from defenses.oracle import QueryBudgetExceeded, QueryOracle
from defenses.threat import Budget, Capability, Goal, Knowledge, Stage, ThreatModel


def predict(x):
    z = np.c_[x[:, 0], -x[:, 0]]
    return np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)


def threat(caps, queries=None):
    return ThreatModel(
        Goal.CONFIDENTIALITY,
        Stage.DEPLOYMENT,
        Knowledge.BLACK_BOX,
        frozenset(caps),
        Budget(queries=queries),
    )


def test_budget_is_enforced_and_queries_counted():
    oracle = QueryOracle.granted_by(predict, threat({Capability.QUERY_SCORES}, 5))
    with recording() as costs:
        assert oracle(np.ones((3, 1))).shape == (3, 2)
        assert oracle.remaining == 2
        with pytest.raises(QueryBudgetExceeded, match="budget of 5"):
            oracle(np.ones((3, 1)))
        oracle(np.ones((2, 1)))
    assert oracle.used == 5
    assert costs["queries"] == 5


def test_label_only_access_hides_scores():
    oracle = QueryOracle.granted_by(predict, threat({Capability.QUERY_LABEL}))
    answer = oracle(np.array([[1.0], [-1.0]]))
    assert answer.tolist() == [0, 1]
    assert oracle.labels_only


def test_no_query_capability_no_oracle():
    with pytest.raises(PermissionError, match="query-scores"):
        QueryOracle.granted_by(predict, threat({Capability.AUX_DATA}))


@pytest.mark.parametrize(
    ("batch", "message"),
    [(np.empty((0, 1)), "non-empty"), (np.array([[np.nan]]), "finite")],
)
def test_bad_queries_are_refused(batch, message):
    oracle = QueryOracle(predict)
    with pytest.raises(ValueError, match=message):
        oracle(batch)
    assert oracle.used == 0


def test_a_system_answering_the_wrong_shape_is_caught():
    oracle = QueryOracle(lambda x: np.ones(len(x)))
    with pytest.raises(ValueError, match="expected"):
        oracle(np.ones((2, 1)))
