r"""The one release path of a DP-SGD step: sanitize, clip, noise, check, normalize.

Every update a client sends is produced by these functions, whatever the server
sent (weights, configs, rounds). One step at sampling rate :math:`q`, noise
multiplier :math:`\sigma`, clip norm :math:`C` and the *public* count :math:`N`
(the node's agreed ``public-num-examples``, never the private data set's size):

.. math::

    \tilde g_i = \begin{cases} g_i & g_i\ \text{finite}\\ 0 & \text{else}\end{cases},
    \quad
    \bar g = \frac{1}{qN}\Big(\sum_{i\in B} \tilde g_i
             \min\big(1, C/\lVert \tilde g_i\rVert\big) + \mathcal N(0, \sigma^2C^2I)
             \Big).

* **Sanitize before clipping.** A per-example gradient (or loss) that is not finite
  (a crafted model can overflow one record's logits) cannot be bounded by clipping:
  :math:`\min(1, C/\lVert g\rVert)` is NaN for a NaN gradient and the whole sum with
  it. Such a record contributes the zero vector instead. Its contribution is still a
  function of that record alone (and of the public weights) with norm
  :math:`\le C`, so adding or removing one record moves the clipped sum by at most
  :math:`C` and the Gaussian mechanism's sensitivity, hence the accountant's
  epsilon, is unchanged. A gradient that is finite but whose norm overflows gets
  clip factor 0 (also a zero contribution). Zero is chosen over a fixed non-zero
  vector because it is the only value every model shares.
* **Check the noised sum.** The clipped sum has norm :math:`\le C|B|`, so the noised
  sum is finite; :func:`noised_sum` still checks it and, if it were not, releases the
  noise alone (a draw that does not depend on the data), never a NaN.
* **Normalize by a public constant.** Dividing by :math:`qN` with :math:`N` public
  is post-processing; dividing by :math:`q n` with the private :math:`n` would
  make the noise's standard deviation (read off an update of a zeroed model)
  reveal :math:`n`.
* **Post-processing stays finite.** Weights :math:`w - \eta \bar g` may overflow
  when the server sends huge weights; :func:`finite_release` clamps them
  (NaN to 0, :math:`\pm\infty` to the largest float), a deterministic function
  of released values, so the reply is always a finite update and never an error.

Floating-point caveat (Mironov, CCS 2012): the Gaussian draw is numpy's (or
torch's) double-precision sampler, not a discretized mechanism; the suite makes
the same approximation as Opacus without ``secure_mode``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from defenses.arrays import FloatArray

logger = logging.getLogger(__name__)


def sanitize_rows(rows: FloatArray) -> FloatArray:
    """``rows`` with every row holding a non-finite value replaced by zeros."""
    out = np.array(rows, dtype=np.float64, copy=True)
    if out.size:
        bad = ~np.isfinite(out.reshape(out.shape[0], -1)).all(axis=1)
        out[bad] = 0.0
    return out


def clip_factors(norms: FloatArray, clip: float) -> FloatArray:
    r"""Per-example factors :math:`\min(1, C/\lVert g\rVert)`; 0 where not finite."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        factor = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    return np.where(np.isfinite(norms) & np.isfinite(factor), factor, 0.0)


def noised_sum(
    clipped_sum: FloatArray, sigma: float, clip: float, rng: np.random.Generator
) -> FloatArray:
    r"""The Gaussian mechanism :math:`S + \mathcal N(0, \sigma^2 C^2 I)`, finite.

    ``clipped_sum`` is a sum of sanitized, clipped per-example gradients (norm
    :math:`\le C|B|`), so the result is finite; if it is not (a caller broke that
    contract), the noise alone is released, which depends on no record.
    """
    noise = rng.normal(0.0, sigma * clip, size=clipped_sum.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(clipped_sum + noise, dtype=np.float64)
    if not np.isfinite(out).all():
        logger.error("non-finite noised sum: released the noise alone")
        return np.asarray(noise, dtype=np.float64)
    return out


def expected_batch(rate: float, public_count: int) -> float:
    """The public normalizer :math:`qN` (``public_count`` >= 1 is the agreed count)."""
    if isinstance(public_count, bool) or int(public_count) != public_count:
        raise ValueError(f"public_count must be an integer >= 1, got {public_count!r}")
    if public_count < 1:
        raise ValueError(f"public_count must be an integer >= 1, got {public_count!r}")
    return float(rate) * int(public_count)


def finite_release(arrays: Sequence[FloatArray]) -> list[FloatArray]:
    """Arrays made finite by post-processing: NaN -> 0, +-inf -> +-largest float.

    Applied to weights computed from released (noised) gradients and public
    weights, it is a deterministic function of released values and spends no
    budget. Integer and boolean arrays pass unchanged.
    """
    out = []
    changed = 0
    for a in arrays:
        arr = np.asarray(a)
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            changed += 1
            arr = np.nan_to_num(arr, copy=True)
        out.append(arr)
    if changed:
        logger.warning(
            "%d released array(s) overflowed after the noise (the weights sent were "
            "huge): clamped to finite values (post-processing)",
            changed,
        )
    return out
