"""Small models and fast settings shared by the audit tests."""

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer

from defenses.audit import AuditConfig, ShadowConfig
from defenses.audit.examples import build_mlp
from defenses.ssd.attacks import BoundaryRepulsion, GeneticInversion

FAST = AuditConfig(
    seeds=(0,),
    shadows=ShadowConfig(n_shadows=2),
    per_target=2,
    brep=BoundaryRepulsion(n_init=64, n_dirs=8, iterations=3),
    mirror=GeneticInversion(n_init=64, population=8, generations=3, elite=2),
    progress=False,
)


@pytest.fixture(scope="session")
def cancer():
    """A fitted MLP pipeline on 120 breast-cancer members, 120 non-members."""
    X, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(0).permutation(y.size)
    members, non_members = order[:120], order[120:240]
    model = build_mlp(0).fit(X[members], y[members])
    return model, (X[members], y[members]), (X[non_members], y[non_members])
