"""Every ```python block of the README and of docs/*.md runs."""

import re
from pathlib import Path

import pytest

from defenses.threads import single_thread

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def blocks():
    """Every distinct block once (the README repeats the pages' quick-tour snippets)."""
    seen = set()
    for page in PAGES:
        for number, code in enumerate(BLOCK.findall(page.read_text()), 1):
            if code not in seen:
                seen.add(code)
                yield pytest.param(code, id=f"{page.name}#{number}")


@pytest.mark.parametrize("code", list(blocks()))
def test_example_runs(code):
    """The block runs with one torch and one BLAS thread, as the suite's tests do.

    The examples train tiny models, for which two threads on a shared 2-core machine
    cost several times the CPU of one (the audit page's CNN: 8-11 s against 1.4 s,
    measured side by side under load); a block's own ``torch.set_num_threads`` no
    longer leaks into the tests after it (the count is restored).
    """
    with single_thread():
        exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})


def test_the_api_reference_builds_strictly_from_the_docstrings(tmp_path):
    """`make docs`: mkdocs + mkdocstrings, warnings are errors (mkdocs.yml)."""
    import subprocess
    import sys

    site = tmp_path / "site"
    config = ["-f", str(ROOT / "mkdocs.yml"), "-d", str(site)]
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", *config],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = {
        "core": ["defenses.threat.ThreatModel", "defenses.harness.evaluate"],
        "ssd": ["defenses.ssd.StealthyShield"],
        "rps": ["defenses.rps"],
        "federated": ["defense_suite.federated"],
        "crypto": ["defense_suite.crypto"],
        "suite": ["defense_suite.spec.SummarySettings", "defense_suite.extras"],
    }
    for page, names in expected.items():
        html = (site / page / "index.html").read_text(encoding="utf-8")
        for name in names:
            assert f'id="{name}"' in html, (page, name)
