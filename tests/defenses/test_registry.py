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


def test_register_package_registers_by_name_and_by_key():
    @dataclass
    class TestOnlyAttack:
        name = "test-only-attack"

    def test_only_benchmark(params, seeds):
        return []

    registry.register_package(
        attacks=[TestOnlyAttack],
        benchmarks={"test-only-benchmark": test_only_benchmark},
    )
    assert registry.load("attacks", "test-only-attack") is TestOnlyAttack
    assert registry.load("benchmarks", "test-only-benchmark") is test_only_benchmark
    with pytest.raises(ValueError, match="already taken"):
        registry.register_package(benchmarks={"test-only-benchmark": dict})


# Discovery without flwr and opacus (only the Flower app left out, named with the
# library it lacks, every other package loaded) is checked in the same fresh
# interpreter as `list` without them: tests/benchmarks/test_extras.py,
# test_list_without_tenseal_and_flower_marks_exactly_what_cannot_run.
