"""Defenses that compose, which no single paper offers.

* :mod:`defenses.composition.benchmark.shielded_federated`: SSD's output
  post-processor wrapping a global model trained with time-adaptive DP federated
  learning. Post-processing cannot weaken differential privacy, so the model keeps
  its per-client epsilon while its deployed outputs are shielded against black-box
  inversion.
* :mod:`defenses.composition.s3t_rps`: the shards of an S3T (or SISA) unlearner serve
  as the partitioned classifiers of RPS. One set of models gives exact unlearning and
  reliable conformal sets; a sample's id fixes its shard, so the poisoning
  certificate stays valid after deletions.
"""
