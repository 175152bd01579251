from __future__ import annotations

import dataclasses
import pathlib

import pytest

from defenses.civet.figures import draw
from defenses.civet.scenario import civet_eps as eps_sweep

TINY_SWEEP = {
    "data": "digits",
    "eps": 0.2,
    "eval_eps": [0.0, 0.2],
    "methods": ["civet", "standard"],
    "epochs": 3,
    "batch_size": 64,
    "lr": 0.02,
    "warmup": 0,
    "n_eval": 8,
    "mc_samples": 16,
    "latent_dim": 2,
    "attack_steps": 5,
    "attack_restarts": 1,
}


def test_eps_sweep_records_every_method_and_radius(tmp_path: pathlib.Path) -> None:
    results = list(eps_sweep(TINY_SWEEP, [0]))
    assert [(r.defense, r.params["benchmark"]["eval_eps"]) for r in results] == [
        ("none", 0.0),
        ("none", 0.2),
        ("civet", 0.0),
        ("civet", 0.2),
    ]
    for r in results:
        assert r.success["violation_rate"] == 0.0
        assert r.success["attack_loss"] <= r.certificate["bound_max"] + 1e-6
        assert r.cost["epoch_s"] > 0
    assert results[0].cost["epoch_ratio"] == 1.0
    assert results[2].cost["epoch_ratio"] > 0
    # the certificate grows with the radius
    assert results[1].certificate["bound"] >= results[0].certificate["bound"]
    assert all(
        r.certificate["bound_crown"] <= r.certificate["bound"] + 1e-9 for r in results
    )
    assert all(
        r.certificate["bound_exact"] <= r.certificate["bound"] + 1e-9 for r in results
    )
    tagged = [
        dataclasses.replace(r, meta={**r.meta, "spec": "civet_eps-quick"})
        for r in results
    ]
    figures = draw(tagged, tmp_path)
    assert len(figures) == 1
    caption, path = figures[0]
    assert "digits" in caption
    assert path.exists()
    assert path.stat().st_size > 1000
    assert draw(results, tmp_path / "none") == []


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"eval_eps": [0.1, 2.0]}, "eval_eps must be a non-empty list of radii"),
        ({"methods": ["lipschitz"]}, "methods must be a subset"),
        ({"speed": 3}, r"unknown parameter\(s\) \['speed'\]"),
        ({"data": "mnist"}, "data must be one of"),
    ],
)
def test_eps_sweep_rejects_bad_parameters(
    change: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        list(eps_sweep({**TINY_SWEEP, **change}, [0]))
