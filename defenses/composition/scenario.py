"""Register the composition benchmarks."""

from defenses.composition.benchmark.s3t_rps import BENCHMARK as S3T_RPS
from defenses.composition.benchmark.s3t_rps import s3t_rps
from defenses.composition.benchmark.shielded_federated import (
    BENCHMARK,
    shielded_federated,
)
from defenses.registry import register

register("benchmarks", BENCHMARK)(shielded_federated)
register("benchmarks", S3T_RPS)(s3t_rps)
