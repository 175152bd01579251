"""Importing the HE package and its protocol pulls no heavy library (issue 20)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "sklearn", "tenseal", "scipy.stats", "matplotlib")


@pytest.mark.parametrize(
    "module",
    [
        "defense_suite.crypto",
        "defense_suite.crypto.protocol",
        "defense_suite.crypto.transport",
    ],
)
def test_import_pulls_no_heavy_library(module: str) -> None:
    code = (
        f"import sys, {module}; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()} eagerly"
