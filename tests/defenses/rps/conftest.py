import numpy as np
import pytest
import torch

from defenses.data import load_digits, stratified_split


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def digits_split():
    data = load_digits()
    tr, ca, te = stratified_split(data.y, [0.45, 0.33, 0.22], np.random.default_rng(0))
    return (data.X[tr], data.y[tr]), (data.X[ca], data.y[ca]), (data.X[te], data.y[te])
