"""The composition benchmarks: one module per composition.

* :mod:`~defenses.composition.benchmark.shielded_federated`: SSD shielding a
  time-adaptive DP federated model.
* :mod:`~defenses.composition.benchmark.s3t_rps`: S3T (or SISA) shards serving as the
  parts of RPS, before and after deletion streams.
"""
