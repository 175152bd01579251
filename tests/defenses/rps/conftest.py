import numpy as np
import pytest

from defenses.data import load_digits, stratified_split
from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture


@pytest.fixture(scope="session")
def digits_split():
    data = load_digits()
    tr, ca, te = stratified_split(data.y, [0.45, 0.33, 0.22], np.random.default_rng(0))
    return (data.X[tr], data.y[tr]), (data.X[ca], data.y[ca]), (data.X[te], data.y[te])
