import pytest

from defense_suite.spec import SpecError, load_spec, parse, sweep

GAME = {
    "title": "t",
    "scenario": "digits-membership",
    "attacks": ["loss-mia"],
    "defenses": ["none", "rounding"],
    "seeds": [0, 1],
}


def test_sweep_is_a_cartesian_product():
    settings = list(sweep({"a": [1, 2], "b": "x", "c": [[3, 4]]}))
    assert settings == [
        {"a": 1, "b": "x", "c": [3, 4]},
        {"a": 2, "b": "x", "c": [3, 4]},
    ]


def test_game_spec_parses():
    spec = parse(
        {**GAME, "params": {"defense": {"rounding": {"decimals": [0, 1]}}}}, "x-quick"
    )
    assert spec.package == "x"
    assert [s for s in spec.component_settings("defense", "rounding")] == [
        {"decimals": 0},
        {"decimals": 1},
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "red"}, r"unknown key\(s\) \['colour'\]"),
        ({"seeds": [0, -1]}, "seeds must be"),
        ({"seeds": "0"}, "seeds must be"),
        ({"title": 3}, "title must be a string"),
        ({"attacks": []}, "at least one attack"),
        ({"attacks": [1]}, "list of strings"),
        ({"benchmark": "speed"}, "exactly one of"),
        ({"params": {"model": {}}}, r"unknown params section\(s\) \['model'\]"),
        ({"params": {"defense": {"ssd": {}}}}, r"names \['ssd'\]"),
        ({"params": {"defense": {"rounding": 3}}}, "must be a table"),
        ({"report": {"colour": 1}}, r"unknown report key\(s\)"),
        ({"report": {"x": 1}}, "metric path"),
    ],
)
def test_bad_specs_name_the_problem(change, message):
    with pytest.raises(SpecError, match=message):
        parse({**GAME, **change}, "bad")


def test_benchmark_spec_rejects_game_keys():
    with pytest.raises(SpecError, match="belongs to game specs"):
        parse({"benchmark": "b", "attacks": ["a"]}, "b")


def test_shipped_specs_are_valid():
    from pathlib import Path

    from defense_suite.runner import plan

    specs = sorted(Path("benchmarks/specs").glob("*.toml"))
    assert any(p.name == "reference-quick.toml" for p in specs)
    for path in specs:
        # every component is built (its parameters checked) without running anything
        chosen = plan(load_spec(path), None, str(path))
        assert chosen.size > 0


def test_invalid_toml_is_reported(tmp_path):
    path = tmp_path / "broken-quick.toml"
    path.write_text("title = \n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(path)
