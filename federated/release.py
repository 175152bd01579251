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
import math
from collections.abc import Sequence

import numpy as np

from defenses.arrays import FloatArray

logger = logging.getLogger(__name__)

TINY_NORM = 1e-300
"""Floor of a norm in :math:`C/\\lVert g\\rVert` (a zero gradient gets factor 1)."""


def fp_quiet() -> np.errstate:
    """The release path's floating-point state: overflow, invalid, divide silent.

    Non-finite intermediates are the rule's business (sanitized, factor 0), never a
    warning or an exception. The fused functions (:func:`clip_rows`,
    :func:`add_noise`) run under it: a client's round enters it once.
    """
    return np.errstate(over="ignore", invalid="ignore", divide="ignore")


def clip_rows(rows: FloatArray, scale: FloatArray, clip: float) -> FloatArray:
    r"""Sanitize and clip per-example rows in place (fused); returns ``rows``.

    Row :math:`i` stands for a per-example gradient of norm
    :math:`\lVert r_i\rVert s_i` (``scale`` :math:`s_i > 0`; the softmax step's
    :math:`\sqrt{\lVert x_i\rVert^2 + 1}`). It becomes
    :math:`r_i \min(1, C / (\lVert r_i\rVert s_i))` if that norm is finite, else
    zero. A row holding NaN or inf has a non-finite norm, so this sanitizes
    (a non-finite row becomes zero) and clips (factor 0 for a norm that is not
    finite) in one pass and no copy: every row finite with norm :math:`\le C`
    (a finite row whose norm overflows is +0.0, where multiplying it by factor 0
    gave zeros of either sign). Constant work: no branch on the values. Run it
    under :func:`fp_quiet` (its values are the same under any floating-point
    state that does not raise).
    """
    norms = np.sqrt(np.add.reduce(rows * rows, axis=1))
    norms *= scale
    rows *= np.minimum(1.0, clip / np.maximum(norms, TINY_NORM))[:, None]
    rows[~np.isfinite(norms)] = 0.0
    return rows


def gaussian_noise(
    rng: np.random.Generator, shape: tuple[int, ...], sigma: float, clip: float
) -> FloatArray:
    r"""Draws of :math:`\mathcal N(0, \sigma^2 C^2)` of ``shape``, from ``rng``.

    One draw of shape ``(steps, p)`` is the same stream as ``steps`` draws of
    ``p`` (a round draws its steps' noise at once).
    """
    return rng.normal(0.0, sigma * clip, size=shape)


def add_noise(total: FloatArray, noise: FloatArray) -> FloatArray:
    r"""The Gaussian mechanism in place: each row of ``total`` += ``noise``; finite.

    ``total`` is (releases, p): each row a sum of sanitized, clipped per-example
    gradients (norm :math:`\le C|B|`), so each noised row is finite; a row that
    is not (a caller broke that contract) becomes its noise alone, which depends
    on no record. A finite sum of all entries proves them all finite; only when
    it is not are the rows checked one by one. Returns ``total``. Run it under
    :func:`fp_quiet`.
    """
    total += noise
    if not math.isfinite(np.add.reduce(total, axis=None)):
        bad = ~np.isfinite(total).all(axis=1)
        if bad.any():
            logger.error("non-finite noised sum: released the noise alone")
            total[bad] = noise[bad]
    return total


def noised_sum(
    clipped_sum: FloatArray, sigma: float, clip: float, rng: np.random.Generator
) -> FloatArray:
    r"""The Gaussian mechanism :math:`S + \mathcal N(0, \sigma^2 C^2 I)`, finite.

    ``clipped_sum`` is a sum of sanitized, clipped per-example gradients (norm
    :math:`\le C|B|`), so the result is finite; if it is not (a caller broke that
    contract), the noise alone is released, which depends on no record
    (:func:`add_noise`).
    """
    noise = gaussian_noise(rng, clipped_sum.shape, sigma, clip)
    out = np.array(clipped_sum, dtype=np.float64, copy=True)
    with fp_quiet():
        add_noise(out.reshape(1, -1), noise.reshape(1, -1))
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
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
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
