"""Every ```python block of the README and of docs/*.md runs."""

import re
from pathlib import Path

import pytest

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
    exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
