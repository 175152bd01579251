import json

import pytest

from defenses.results import Result, describe, read_jsonl, summarize, write_jsonl
from defenses.testing import make_result


def make(defense="none", seed=0, auc=0.7, acc=0.9):
    return make_result(
        defense,
        seed,
        utility={"accuracy": acc},
        success={"auc": auc},
        cost={"fit_s": 0.1},
    )


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "r.jsonl"
    results = [make(seed=s) for s in range(3)]
    assert write_jsonl(results, path) == 3
    assert read_jsonl(path) == results


def test_corrupt_lines_are_reported_with_their_position(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"scenario": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_jsonl(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_metrics_are_refused(value):
    with pytest.raises(
        ValueError, match=r"Result.success\['auc'\] is .*must be finite"
    ):
        make(auc=value)


def test_non_finite_metrics_are_refused_by_type():
    with pytest.raises(TypeError, match="must be a number"):
        make(auc="high")


def test_summarize_means_and_std():
    results = [make(seed=s, auc=v) for s, v in enumerate([0.6, 0.7, 0.8])]
    ((_, cells),) = summarize(results, ["success.auc", "success.missing"])
    assert cells["success.auc"].mean == pytest.approx(0.7)
    assert cells["success.auc"].std == pytest.approx(0.1)
    assert cells["success.missing"] is None


def test_get_names_bad_paths():
    with pytest.raises(KeyError, match="section"):
        make().get("auc")
    with pytest.raises(KeyError, match="success has"):
        make().get("success.tpr")


def test_describe_needs_values():
    with pytest.raises(ValueError, match="empty"):
        describe([])
    assert describe([1.0]).std == 0.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"utility": [1, 2]}, "Result.utility must be a mapping"),
        ({"params": None}, "Result.params must be a mapping"),
        ({"meta": "x"}, "Result.meta must be a mapping"),
        ({"seed": 1.5}, "Result.seed must be an integer"),
        ({"seed": True}, "Result.seed must be an integer"),
        ({"defense": None}, "Result.defense must be a string"),
    ],
)
def test_malformed_fields_are_refused(change, message):
    record = {**make().to_dict(), **change}
    with pytest.raises(TypeError, match=message):
        Result.from_dict(record)


def test_read_jsonl_names_the_file_and_line(tmp_path):
    good = json.dumps(make().to_dict())
    path = tmp_path / "r.jsonl"
    path.write_text(good + "\n\n" + good.replace("0.7", "Infinity") + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:3: not a result record: .*finite"):
        read_jsonl(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"r\.jsonl:1: .*JSON object"):
        read_jsonl(path)
    with pytest.raises(ValueError, match="is a directory"):
        read_jsonl(tmp_path)
    with pytest.raises(ValueError, match="no such results file"):
        read_jsonl(tmp_path / "missing.jsonl")
