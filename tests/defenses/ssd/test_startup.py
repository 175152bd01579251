"""``import defenses.ssd`` stays light: torch, scikit-learn, SciPy's heavy parts and
numba are imported only by the code that needs them (a tensor, a module, a wrapper,
the first call of a compiled kernel).

Each check runs a fresh interpreter and reads ``sys.modules``; it is not a timing
test (``benchmarks/startup.py`` measures the time).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = (
    "torch",
    "sklearn",
    "pandas",
    "scipy.stats",
    "scipy.special",
    "scipy.sparse",
    "numba",
)
COMPILER = ["numba"]  # imported by the first call, which runs a compiled kernel


def loaded_after(code: str) -> list[str]:
    """The HEAVY modules a fresh interpreter holds after running ``code``."""
    probe = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    loaded: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


@pytest.mark.parametrize("module", ["defenses", "defenses.ssd"])
def test_import_pulls_no_heavy_dependency(module):
    assert loaded_after(f"import {module}") == []


def test_a_numpy_shield_runs_without_torch_or_sklearn():
    code = """
import numpy as np
from defenses.ssd import StealthyShield, entropy, water_filling
val = np.array([[.9, .05, .05], [.1, .8, .1], [.05, .15, .8]])
shield = StealthyShield(epsilon=1.0, seed=0).fit(val, np.array([0, 1, 2]))
assert shield(val).shape == (3, 3)
shield.set_params(seeding="input-hash")
assert shield(val, inputs=np.arange(6.0).reshape(3, 2)).shape == (3, 3)
assert entropy(val).shape == (3,)
assert water_filling(val, val[::-1], np.full(3, 0.1)).shape == (3, 3)
"""
    assert loaded_after(code) == COMPILER


def test_wrapping_a_scikit_learn_model_does_not_import_torch():
    code = """
import numpy as np
from sklearn.linear_model import LogisticRegression
from defenses.ssd import StealthyShield
x = np.random.default_rng(0).normal(size=(30, 2))
y = (x[:, 0] > 0).astype(int)
model = LogisticRegression().fit(x, y)
shield = StealthyShield(seed=0).fit(model.predict_proba(x), y)
assert shield.wrap(model).predict_proba(x).shape == (30, 2)
"""
    loaded = loaded_after(code)
    assert "torch" not in loaded
    assert "sklearn" in loaded
