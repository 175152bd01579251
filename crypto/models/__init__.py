"""The HE-friendly transformer and its plaintext training (issue 41, layer 2).

* :mod:`~crypto.models.heformer` - :class:`~crypto.models.heformer.HEFormer`, the
  scaled-down encryption-friendly transformer (Gaussian-kernel attention,
  polynomial non-linearities, LoRA on Q, K, V);
* :mod:`~crypto.models.train` - pretraining, calibration, polynomial-mode training
  and personalisation, with the HE approximations in the loop.

A user's Hugging Face model arrives through :mod:`crypto.conversion` instead.
"""
