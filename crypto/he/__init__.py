"""The CKKS backend (issue 41, layer 1): what any encrypted program runs on.

* :mod:`~crypto.he.ckks` - CKKS parameters checked against the HE standard, the
  TenSEAL contexts and backend;
* :mod:`~crypto.he.evaluator` - level-tracking slot-wise arithmetic for any backend
  (the float64 simulation or ciphertexts), with client-aided refreshes;
* :mod:`~crypto.he.packing` - the feature-major, rotation-free layout;
* :mod:`~crypto.he.approx` - polynomial fits on calibrated ranges;
* :mod:`~crypto.he.costmodel` - the cost of an encrypted step from its operation
  counts.

Nothing here knows a model, a program or a protocol.
"""
