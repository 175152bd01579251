from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "civet.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_the_doc_has_a_quick_tour_and_an_example() -> None:
    assert len(BLOCKS) >= 2
    assert 3 <= len(BLOCKS[0].strip().splitlines()) <= 8


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_blocks_run(index: int) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(BLOCKS[index], f"{DOC}:block{index}", "exec"), {})
    assert out.getvalue().strip()
