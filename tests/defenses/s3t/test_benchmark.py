from __future__ import annotations

import pytest

from defenses.s3t.benchmark import deletion_benchmark
from defenses.s3t.figures import figures

TINY = {
    "shards": 2,
    "slices": 2,
    "streams": 2,
    "max_deletions": 30,
    "every": 5,
    "pool": 150,
    "public": 120,
    "width": 24,
    "hidden": 32,
    "blocks": 4,
    "pretrain_epochs": 3,
    "rank": 2,
    "epochs": 2,
    "simulation_runs": 200,
    "bookkeeping_streams": 300,
}


@pytest.fixture(scope="module")
def uniform():
    return {r.defense: r for r in deletion_benchmark(TINY, [0])}


def test_records_and_invariants(uniform) -> None:
    assert set(uniform) == {"none", "sisa", "s3t-b1", "s3t"}
    none, sisa, b1, s3t = (uniform[k] for k in ("none", "sisa", "s3t-b1", "s3t"))
    assert none.utility["deletions_served"] == 1.0
    assert sisa.utility["deletions_served"] == b1.utility["deletions_served"]
    assert s3t.utility["deletions_served"] >= b1.utility["deletions_served"]
    assert s3t.utility["deletions_theory"] > b1.utility["deletions_theory"]
    fit = none.cost["train_passes"]
    assert none.cost["retrain_passes@10"] == pytest.approx(10 * fit)
    assert sisa.cost["retrain_passes@10"] < none.cost["retrain_passes@10"]
    assert s3t.cost["stored_stages"] == 2 * 4
    assert 0 <= s3t.utility["accuracy"] <= 1
    assert s3t.cost["delete_s"] > 0
    assert s3t.params["benchmark"]["sequences"] == 2
    assert sisa.utility["deletions_served_many_over_sisa"] == 1.0
    assert sisa.utility["deletions_served_many_over_sisa_se"] == 0.0
    assert 0 < s3t.utility["deletions_served_many_over_sisa_se"] < 0.1
    assert s3t.utility["deletions_served_many"] > sisa.utility["deletions_served_many"]
    assert s3t.utility["deletions_served_many_se"] > 0
    assert s3t.utility["deletions_theory_sizes_over_sisa"] > 1.0
    assert "deletions_served_many" not in none.utility


def test_skewed_stream_adds_bms() -> None:
    results = list(deletion_benchmark({**TINY, "skew": "zipf", "slices": 3}, [1]))
    names = {r.defense for r in results}
    assert "s3t-bms" in names
    bms = next(r for r in results if r.defense == "s3t-bms")
    assert bms.utility["deletions_simulated"] > 0
    assert "deletions_theory" not in bms.utility


def test_figures_draw_pngs(uniform, tmp_path) -> None:
    import dataclasses

    tagged = [
        dataclasses.replace(r, meta={**r.meta, "spec": "s3t_deletion-quick"})
        for r in uniform.values()
    ]
    made = figures(tagged, tmp_path)
    assert len(made) == 1
    caption, path = made[0]
    assert "m=2 L=2" in caption
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert figures([], tmp_path) == []


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"bogus": 1}, r"unknown parameter\(s\)"),
        ({"streams": 0}, "streams must be an int >= 1"),
        ({"skew": "heavy"}, "skew must be"),
        ({"zipf": 0.0}, r"zipf must be a finite number > 0\.0"),
        ({"pool": -1}, "pool must be"),
    ],
)
def test_bad_parameters(params, match) -> None:
    with pytest.raises(ValueError, match=match):
        list(deletion_benchmark(params, [0]))


@pytest.mark.parametrize("kind", ["s3t", "sisa"])
def test_bookkeeping_streams_match_real_deletions(kind: str) -> None:
    # the many-stream count (a model dies when every (shard, first slice) cell
    # has been hit) is what Unlearner.delete does, stream by stream
    import copy

    import numpy as np

    from defenses.s3t import S3T, SISA
    from defenses.s3t.benchmark import first_hits, needed_cells, stream_positions
    from tests.defenses.s3t.user_modules import SETTINGS, UserMLP, data

    X, y, ids = data(60)
    common = {"rank": 1, "epochs": 1, "batch_size": 32, **SETTINGS}
    model = (
        S3T(UserMLP(), 2, 2, 2, **common)
        if kind == "s3t"
        else SISA(UserMLP(), 2, 2, **common)
    ).fit(X, y, ids)
    cells = np.array([s * 2 + j for s, j in model.locate(ids)])
    position = stream_positions(np.random.default_rng(3), np.full(60, 1 / 60), 6)
    served = first_hits(cells, position)[:, needed_cells(model)].max(axis=1)
    assert len(set(served.tolist())) > 1  # the streams differ
    for r in range(position.shape[0]):
        replay = copy.deepcopy(model)
        deleted = 0
        for target in ids[np.argsort(position[r])]:
            deleted += 1
            if replay.delete([target]).all_dead:
                break
        assert deleted == served[r]


def test_expected_deletions_generalises_the_harmonic_theory() -> None:
    import numpy as np

    from defenses.s3t.sequences import deletion_rate_theory, expected_deletions

    for m, length, firsts in [(3, 3, 3), (3, 3, 1), (5, 6, 6), (5, 6, 2)]:
        equal = np.full(m * firsts, 1 / (m * length))
        assert expected_deletions(equal) == pytest.approx(
            deletion_rate_theory(m, length, firsts), rel=1e-9
        )
    # unequal cells: the exact two-cell value 1/p + 1/q - 1/(p + q)
    assert expected_deletions([0.2, 0.3]) == pytest.approx(5 + 10 / 3 - 2)
    with pytest.raises(ValueError, match="cell_probs"):
        expected_deletions([0.0, 0.5])
