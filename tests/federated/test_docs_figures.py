import re
from pathlib import Path

import pytest

from defense_suite.federated.benchmark import audit_controls
from defenses.registry import load

DOC = Path(__file__).resolve().parents[2] / "docs" / "federated.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_docs_open_with_the_three_pieces_and_have_a_short_quick_tour():
    text = DOC.read_text(encoding="utf-8")
    assert text.splitlines()[2] == "## Add time-adaptive DP to your Flower app"
    for piece in ("TimeAdaptiveMod", "TimeAdaptiveClient", "TimeAdaptiveStrategy"):
        assert piece in BLOCKS[0]
    assert any(3 <= len(b.strip().splitlines()) <= 8 for b in BLOCKS)
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("block", range(len(BLOCKS)))
def test_doc_snippet_runs(block, capsys):
    exec(compile(BLOCKS[block], f"{DOC}:block{block}", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_figures_draw_pngs(tmp_path):
    # the figure only needs results of the spec's shape: 40 trials (20 thresholds
    # per half instead of 100: a fifth of the Clopper-Pearson intervals)
    results = [
        r.__class__(**{**r.to_dict(), "meta": {"spec": "federated_controls-quick"}})
        for r in audit_controls({"trials": 40}, [0])
    ]
    assert len(results) == 4  # the correct accountant and three broken ones
    figures = load("figures", "federated")(results, tmp_path)
    assert figures
    for caption, path in figures:
        assert caption
        assert path.read_bytes()[:4] == b"\x89PNG"
