import re

import pytest

from defense_suite.spec import SpecError, SummarySettings, parse
from defense_suite.summary import (
    DIRECTION_ONLY,
    NOT_REPRODUCED,
    PARTLY,
    REPRODUCED,
    markdown_summary,
    summary_row,
    verdict,
)
from defenses.testing import make_result


def run(defense, seed, value, cert=None):
    return make_result(
        defense,
        seed,
        attack="atk(x=1)",
        utility={"accuracy": 0.9},
        success={"attack_acc": value},
        certificate=cert or {},
    )


CLAIM = {"threat": "t", "metric": "success.attack_acc", "defense": "ssd"}


def settings(**kw):
    return SummarySettings(**{**CLAIM, **kw})


def summary_spec(summary, name="x"):
    """A spec of scenario ``s``, attack ``atk``, whose report summary is ``summary``."""
    spec = {"scenario": "s", "attacks": ["atk"], "report": {"summary": summary}}
    return parse(spec, name)


def summarize(results, name="x-quick", **fields):
    """The summary row of ``results`` under :data:`CLAIM` with ``fields``."""
    row = summary_row(summary_spec({**CLAIM, **fields}, name), results)
    assert row is not None
    return row


@pytest.mark.parametrize(
    ("direction", "change", "defended", "expected"),
    [
        ("lower", 0.5, 0.4, REPRODUCED),
        ("lower", 0.5, 0.6, PARTLY),
        ("lower", 0.5, 1.1, NOT_REPRODUCED),
        ("lower", 0.0, 1.0, NOT_REPRODUCED),
        ("higher", 0.1, 1.2, REPRODUCED),
        ("higher", 0.1, 0.9, NOT_REPRODUCED),
        ("same", 0.05, 0.97, REPRODUCED),
        ("same", 0.05, 1.08, PARTLY),
        ("same", 0.05, 0.85, NOT_REPRODUCED),
        ("within", 0.5, 1.4, REPRODUCED),
        ("within", 0.5, 0.7, REPRODUCED),
        ("within", 0.5, 1.9, PARTLY),
        ("within", 0.5, 2.1, NOT_REPRODUCED),
    ],
)
def test_verdict(direction, change, defended, expected):
    assert (
        verdict(settings(direction=direction, relative_change=change), defended, 1.0)
        == expected
    )


def test_summary_row_pairs_seeds_and_reads_peers_and_guarantee():
    results = [
        run("none", 0, 0.30),
        run("none", 1, 0.20),
        run("ssd(epsilon=1)", 0, 0.02, {"bound": 0.1}),
        run("ssd(epsilon=1)", 1, 0.04, {"bound": 0.3}),
        run("ssd(epsilon=2)", 0, 0.5),
        run("gauss", 0, 0.25),
    ]
    row = summarize(
        results,
        "ssd-quick",
        threat="inversion",
        attack="atk",
        relative_change=0.5,
        peers=["gauss", "missing", "ssd(epsilon=2"],
        guarantee="certificate.bound",
        utility="utility.accuracy",
    )
    assert row.defended.mean == pytest.approx(0.03)
    assert row.undefended.mean == pytest.approx(0.25)
    assert row.delta.mean == pytest.approx(-0.22)
    assert row.delta.n == 2
    # a peer is named by the full label of the arm its prefix matched
    assert [name for name, _ in row.peers] == ["gauss", "ssd(epsilon=2)"]
    assert row.guarantee is not None
    assert row.guarantee[1].mean == pytest.approx(0.2)
    # two seeds: the paired t-interval (one degree of freedom) holds zero
    assert row.interval is not None
    assert row.interval.low < 0 < row.interval.high
    assert row.verdict == PARTLY
    assert row.utility_cost is not None
    assert row.utility_cost[1].mean == pytest.approx(0.0)


def test_bad_summaries_are_refused():
    with pytest.raises(SpecError, match="'metric' is required"):
        summary_spec({"threat": "t", "defense": "d"})
    with pytest.raises(SpecError, match="direction must be"):
        settings(direction="sideways")
    with pytest.raises(SpecError, match=r"unknown key\(s\) \['colour'\]"):
        summary_spec({"threat": "t", "defense": "d", "metric": "m", "colour": 1})


def test_tables_name_the_scenario_settings_that_vary():
    from dataclasses import replace

    from defense_suite.tables import markdown_table

    a = replace(run("none", 0, 0.3), params={"scenario": {"dataset": "digits", "n": 1}})
    b = replace(run("none", 0, 0.4), params={"scenario": {"dataset": "wine", "n": 1}})
    table = markdown_table([a, b], ["success.attack_acc"])
    assert "| s(dataset=digits) | atk(x=1) | none | 1 | 0.300 |" in table
    assert "| s(dataset=wine) |" in table


def test_summary_against_another_baseline():
    results = [
        run("uniform", 0, 0.50),
        run("uniform", 1, 0.60),
        run("ssd", 0, 0.40),
        run("ssd", 1, 0.45),
        run("none", 0, 0.9),
    ]
    row = summarize(results, baseline="uniform", relative_change=0.1)
    assert row.undefended.mean == pytest.approx(0.55)
    assert row.delta.mean == pytest.approx(-0.125)
    assert row.verdict == PARTLY  # two paired seeds cannot exclude zero


@pytest.mark.parametrize(
    ("defended", "expected"),
    [
        ((0.02, 0.03, 0.02, 0.04), REPRODUCED),  # interval below zero, large change
        ((0.10, 0.45, 0.05, 0.40), PARTLY),  # mean down, interval holds zero
        ((0.31, 0.32, 0.33, 0.31), NOT_REPRODUCED),  # interval above zero
    ],
)
def test_the_verdict_follows_the_paired_interval(defended, expected):
    baseline = (0.30, 0.20, 0.25, 0.28)
    results = [run("none", seed, value) for seed, value in enumerate(baseline)]
    results += [run("ssd", seed, value) for seed, value in enumerate(defended)]
    row = summarize(results, relative_change=0.1)
    assert row.interval is not None
    assert row.interval.n == 4
    assert row.verdict == expected
    assert f"(paired Δ {row.interval})" in markdown_summary([row], ["attack_acc"])


def _sized_row(values, **claim):
    """A summary row over paired seeds: ``values`` are (baseline, defended) pairs."""
    results = []
    for seed, (base, defended) in enumerate(values):
        results += [run("none", seed, base), run("ssd", seed, defended)]
    return summarize(
        results,
        "ssd-quick",
        threat="inversion",
        attack="atk",
        relative_change=0.5,
        **claim,
    )


# the ssd-quick run of issue 40: 0.987 -> 0.387 over three seeds, paper 0.268 -> 0.018
SSD_QUICK = [(1.0, 0.2), (1.0, 0.48), (0.96, 0.48)]


def test_a_stated_size_the_change_falls_short_of_is_direction_only():
    row = _sized_row(SSD_QUICK, paper_baseline=0.268, paper_defended=0.018)
    assert row.verdict == DIRECTION_ONLY
    assert row.note.startswith("0.387 against the paper's 0.018")
    assert "magnitude not reproduced" in row.note
    assert "paper 0.268 -> 0.018, -93%; ours 0.987 -> 0.387, -61%" in row.note
    cell = markdown_summary([row], ["success.attack_acc"])
    assert "**direction reproduced, magnitude not**" in cell
    without = _sized_row(SSD_QUICK)  # the same numbers, no stated size
    assert without.verdict == REPRODUCED  # what the report said before
    assert without.note == ""


def test_a_stated_size_that_is_reached_keeps_reproduced():
    row = _sized_row(
        [(1.0, 0.05), (0.9, 0.06), (0.95, 0.05)],
        paper_baseline=0.268,
        paper_defended=0.018,
    )
    assert row.verdict == REPRODUCED
    assert row.note.endswith("magnitude reproduced")


@pytest.mark.parametrize(
    ("claim", "defended", "met"),
    [
        ({"paper_defended": 0.1}, 0.1, True),  # exactly at the value
        ({"paper_defended": 0.1}, 0.11, False),
        ({"paper_ratio": 4.0}, 0.25, True),  # 4x less
        ({"paper_ratio": 4.0}, 0.26, False),
        ({"paper_baseline": 0.5, "paper_defended": 0.2}, 0.4, True),  # -60 %
        ({"paper_baseline": 0.5, "paper_defended": 0.2}, 0.41, False),
    ],
)
def test_the_mean_must_reach_the_stated_size(claim, defended, met):
    row = _sized_row([(1.0, defended), (1.0, defended)], **claim)
    assert (row.verdict == REPRODUCED) is met
    assert row.verdict in (REPRODUCED, DIRECTION_ONLY)


def test_a_size_within_the_interval_but_missed_on_the_mean_says_more_seeds_could_tell():
    row = _sized_row([(1.0, 0.0), (1.0, 0.9)], paper_defended=0.2)
    assert row.verdict != REPRODUCED  # never reproduced on an interval alone
    assert "within the paired 95 % interval" in row.note


def test_a_higher_claim_with_a_speed_up():
    results = [run("none", 0, 1.0), run("ssd", 0, 2.4)]
    row = summarize(
        results, "x", direction="higher", relative_change=0.5, paper_ratio=2.3
    )
    assert row.verdict == REPRODUCED
    assert row.note == "2.4x against the paper's 2.3x: magnitude reproduced"


@pytest.mark.parametrize(
    ("claim", "match"),
    [
        ({"paper_ratio": 0.5}, "paper_ratio must be > 1"),
        ({"paper_ratio": 2.0, "paper_defended": 0.1}, "paper_ratio states the size"),
        ({"paper_baseline": 0.2}, "paper_baseline needs paper_defended"),
        ({"paper_baseline": 0.2, "paper_defended": 0.3}, "must move lower"),
        ({"paper_baseline": 0.0, "paper_defended": -0.3}, "non-zero baseline"),
        ({"paper_defended": "0.1"}, "paper_defended must be a number"),
        ({"paper_defended": float("nan")}, "paper_defended must be a finite number"),
        ({"paper_defended": 0.1, "direction": "same"}, "needs direction"),
    ],
)
def test_stated_sizes_are_checked_naming_the_key(claim, match):
    summary = {"threat": "t", "metric": "success.auc", "defense": "d", **claim}
    with pytest.raises(SpecError, match=match):
        summary_spec(summary)


SIZED = re.compile(r"\d+(?:\.\d+)?\s*%\s*(?:->|to)\s*\d|\d+(?:\.\d+)?x faster")
EXEMPT = {
    # measures the LoRA part alone; the paper's 6.94x is the whole step's (cited)
    "crypto_lora-quick": "the suite's own target",
}


def test_every_shipped_claim_that_states_a_size_carries_it():
    """A claim of '26.8% -> 1.8%' or '6.94x faster' is checked at that size."""
    from pathlib import Path

    from defense_suite.spec import load_spec

    specs = Path(__file__).resolve().parents[2] / "benchmarks" / "specs"
    sized = []
    for path in sorted(specs.glob("*.toml")):
        summary = load_spec(path).report.summary
        if summary is None or not SIZED.search(summary.paper):
            continue
        sized.append(path.stem)
        if path.stem not in EXEMPT:
            assert summary.has_magnitude, path.name
    assert {"ssd-quick", "crypto_finetune-quick"} <= set(sized)
