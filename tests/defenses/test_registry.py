from dataclasses import dataclass

import pytest

from defenses import registry


def test_builtins_are_discovered():
    assert "digits-membership" in registry.available("scenarios")
    assert {"loss-mia", "label-only-mia"} <= set(registry.available("attacks"))
    assert {"rounding", "label-only"} <= set(registry.available("defenses"))


def test_create_checks_parameter_names():
    assert registry.create("defenses", "rounding", {"decimals": 2}).decimals == 2
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['digits'\].*decimals"):
        registry.create("defenses", "rounding", {"digits": 2})


def test_unknown_names_and_kinds():
    with pytest.raises(KeyError, match="no defense named 'nope'"):
        registry.load("defenses", "nope")
    with pytest.raises(ValueError, match="unknown registry kind"):
        registry.load("models", "x")  # type: ignore[arg-type]


def test_a_name_cannot_be_taken_twice():
    @dataclass
    class One:
        pass

    registry.register("figures", "test-only-name")(One)
    registry.register("figures", "test-only-name")(One)
    with pytest.raises(ValueError, match="already taken"):
        registry.register("figures", "test-only-name")(dict)
