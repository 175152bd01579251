"""Defenses that compose, which no single paper offers.

* :mod:`defenses.composition.shielded_federated`: SSD's output post-processor wrapping
  a global model trained with time-adaptive DP federated learning. Post-processing
  cannot weaken differential privacy, so the model keeps its per-client epsilon while
  its deployed outputs are shielded against black-box inversion.
"""
