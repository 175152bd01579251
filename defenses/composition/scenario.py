"""Register the composition benchmarks."""

from defenses.composition.shielded_federated import BENCHMARK, shielded_federated
from defenses.registry import register

register("benchmarks", BENCHMARK)(shielded_federated)
