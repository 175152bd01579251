from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "civet.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_the_doc_opens_with_bring_your_own_model_then_a_quick_tour() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert text.index("## Bring your own model") < text.index("```python")
    assert len(BLOCKS) >= 3
    assert "class MyVAE(nn.Module)" in BLOCKS[0]
    assert 3 <= len(BLOCKS[1].strip().splitlines()) <= 8


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_blocks_run(index: int) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(BLOCKS[index], f"{DOC}:block{index}", "exec"), {})
    assert out.getvalue().strip()
