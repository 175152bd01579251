"""Plots speak to a reader: titles that fit, axes in words, groups by what differs."""

from dataclasses import replace
from pathlib import Path

import pytest

from defense_suite.labels import METRIC_LABELS, delta_label, fit_title, metric_label
from defense_suite.plots import delta_figure, tradeoff_figure, tradeoff_plot
from defense_suite.spec import load_spec
from defenses.testing import make_result

LONG = (
    "Time-adaptive DP federated learning: accuracy and membership inference on two "
    "data sets and two models, with a title long enough to be cut off (quick)"
)


def run(defense, seed, auc, dataset="digits"):
    return make_result(
        defense,
        seed,
        scenario="federated-membership",
        attack="loss-mia",
        utility={"accuracy": 0.8 + 0.01 * seed},
        success={"auc": auc, "label_advantage": 0.1},
        params={"scenario": {"dataset": dataset, "model": "softmax", "rounds": 5}},
    )


def two_datasets():
    return [
        run(defense, seed, auc + 0.01 * seed, dataset)
        for dataset in ("digits", "coarse_to_fine")
        for defense, auc in (("none", 0.7), ("time-adaptive", 0.6))
        for seed in (0, 1)
    ]


def test_every_plotted_metric_of_every_shipped_spec_has_words():
    missing = {}
    for path in sorted(Path("benchmarks/specs").glob("*.toml")):
        report = load_spec(path).report
        for metric in (report.x, report.y):
            if metric is not None and metric not in METRIC_LABELS:
                missing[path.name] = metric
    assert missing == {}


def test_labels_are_words_not_paths():
    assert metric_label("success.auc") == "membership-inference AUC (0.5 = chance)"
    assert metric_label("success.label_advantage").startswith("curious server")
    fallback = metric_label("success.acc@5")
    assert fallback == "acc at 5 (attack success)"
    assert metric_label("cost.unlearn_s") == "unlearn time (s) (cost)"
    assert "success.auc" not in delta_label("success.auc")
    assert "defended minus undefended" in delta_label("success.auc")


@pytest.mark.parametrize("width", [5.2, 8.0, 16.0])
def test_titles_are_wrapped_to_the_figure(width):
    lines = fit_title(LONG, width).splitlines()
    assert (len(lines) > 1) == (width < 10)
    assert " ".join(lines) == LONG
    limit = int(width * 72 / 5.5)
    assert all(len(line) <= limit for line in lines)


def test_tradeoff_figure_has_a_panel_per_dataset_and_words_on_its_axes():
    fig = tradeoff_figure(two_datasets(), "utility.accuracy", "success.auc", LONG)
    axes = fig.axes
    assert len(axes) == 2
    assert [ax.get_title() for ax in axes] == [
        "attack: loss-mia\ndataset=digits",
        "attack: loss-mia\ndataset=coarse_to_fine",
    ]
    assert all(ax.get_xlabel() == "test accuracy (fraction correct)" for ax in axes)
    assert axes[0].get_ylabel() == "membership-inference AUC (0.5 = chance)"
    title = fig._suptitle.get_text()
    assert title.replace("\n", " ") == LONG
    assert "\n" in title


def test_delta_bars_name_the_setting_that_differs():
    fig = delta_figure(two_datasets(), "success.auc", "paired deltas")
    assert fig is not None
    (ax,) = fig.axes
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == [
        "dataset=digits\ntime-adaptive",
        "dataset=coarse_to_fine\ntime-adaptive",
    ]
    assert "defended minus undefended" in ax.get_ylabel()
    assert "success.auc" not in ax.get_ylabel()
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == pytest.approx([-0.1, -0.1])


def test_delta_figure_without_a_pair_is_none():
    assert delta_figure([run("time-adaptive", 0, 0.5)], "success.auc") is None


def test_tradeoff_plot_writes_a_png(tmp_path):
    results = [replace(r, params={}) for r in two_datasets()[:4]]
    out = tradeoff_plot(results, "utility.accuracy", "success.auc", tmp_path / "p.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
