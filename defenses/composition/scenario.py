"""Register the composition benchmarks."""

from defenses.composition.s3t_rps_bench import BENCHMARK as S3T_RPS
from defenses.composition.s3t_rps_bench import s3t_rps
from defenses.composition.shielded_federated import BENCHMARK, shielded_federated
from defenses.registry import register

register("benchmarks", BENCHMARK)(shielded_federated)
register("benchmarks", S3T_RPS)(s3t_rps)
