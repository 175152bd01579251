"""save_figure, and the package figures that end with it, drawn from made-up results."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from defenses.plotting import save_figure
from defenses.registry import load
from defenses.results import Result

PNG = b"\x89PNG"


def _result(scenario, defense, spec, benchmark, **sections):
    return Result(
        scenario=scenario,
        attack=sections.pop("attack", "none"),
        defense=defense,
        seed=sections.pop("seed", 0),
        threat={},
        utility=sections.pop("utility", {}),
        success=sections.pop("success", {}),
        cost=sections.pop("cost", {}),
        certificate=sections.pop("certificate", {}),
        params={"benchmark": benchmark},
        meta={"spec": spec},
    )


def test_save_figure_writes_a_png_into_a_new_folder_and_closes_the_figure(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    out = tmp_path / "deep" / "er" / "plot.png"
    assert save_figure(fig, out, dpi=50) == out
    assert out.read_bytes()[:4] == PNG
    assert not plt.fignum_exists(fig.number)


def test_save_figure_honours_the_resolution(tmp_path):
    sizes = []
    for dpi in (40, 120):
        fig, _ = plt.subplots(figsize=(2, 2))
        sizes.append(save_figure(fig, tmp_path / f"{dpi}.png", dpi=dpi).stat().st_size)
    assert sizes[0] < sizes[1]


def _rps_runs(scenarios):
    runs = []
    for seed in (0, 1):
        for k_t in (2, 4):
            bench = {
                "dataset": "wine",
                "n_train_parts": k_t,
                "n_calib_parts": 2,
                "confidence_level": 0.9,
            }
            cert = {"robust_rt1": 0.8, "robust_rt2": 0.6, "robust_rc1": 0.7}
            util = {"coverage": 0.9 + 0.01 * seed, "set_size": 1.5}
            for scenario in scenarios:
                runs.append(
                    _result(
                        scenario,
                        "rps",
                        "rps-quick",
                        bench,
                        seed=seed,
                        utility=util,
                        certificate=cert,
                    )
                )
    return runs


@pytest.mark.parametrize(
    ("scenarios", "expected"),
    [
        (
            ("rps-tradeoff", "rps-coverage"),
            ["rps_tradeoff_wine.png", "rps_coverage.png", "rps_certified.png"],
        ),
        (("rps-coverage",), ["rps_coverage.png"]),
        (("rps-tradeoff",), ["rps_tradeoff_wine.png", "rps_certified.png"]),
    ],
)
def test_rps_draws_each_figure_its_scenario_has_runs_for(tmp_path, scenarios, expected):
    drawn = load("figures", "rps")(_rps_runs(scenarios), tmp_path)
    assert [path.name for _, path in drawn] == expected
    for caption, path in drawn:
        assert caption
        assert path.read_bytes()[:4] == PNG


def test_rps_draws_nothing_for_other_packages(tmp_path):
    runs = [
        r.__class__(**{**r.to_dict(), "meta": {"spec": "ssd-quick"}})
        for r in _rps_runs(("rps-coverage",))
    ]
    assert load("figures", "rps")(runs, tmp_path) == []


def test_ssd_draws_the_speed_and_trade_off_figures(tmp_path):
    import defenses.ssd.scenario  # noqa: F401  (registers the figures)

    runs = [
        _result("ssd-perf", variant, "ssd-perf", {"K": k}, cost={"per_row_us": us})
        for variant, k, us in (("none", 10, 1.0), ("none", 100, 5.0), ("ws", 10, 2.0))
    ]
    runs += [
        _result(
            "ssd-digits",
            defense,
            "ssd-quick",
            {},
            attack="ssd-brep",
            utility={"accuracy": acc},
            success={"acc@1": hit},
        )
        for defense, acc, hit in (
            ("none", 0.95, 0.8),
            ("ssd-shield(epsilon=0.5)", 0.94, 0.3),
            ("ssd-shield(epsilon=1.0)", 0.92, 0.2),
        )
    ]
    drawn = load("figures", "ssd")(runs, tmp_path)
    assert sorted(path.name for _, path in drawn) == [
        "ssd-perf-speed.png",
        "ssd-quick-tradeoff.png",
    ]
    for _, path in drawn:
        assert path.read_bytes()[:4] == PNG
