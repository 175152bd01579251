r"""The measured encrypted logit error of converted BERTs, per depth and width.

:data:`MEASURED` holds, per (layers, width), the largest difference
:math:`\max_{i,c} |\hat z_{ic} - z_{ic}|` between the encrypted logits
:math:`\hat z` (CKKS, the ``INTERACTIVE`` chain: N 8192, 30-bit scale,
client-aided refreshes) and the plaintext polynomial model's :math:`z`, over
the rows of ``crypto_convert_error-full`` (:mod:`crypto.benchmark.convert_error`:
random-weight conversions with two initialisations and distilled ones, one packed
batch of up to 200 sequences each). :func:`expected_logit_error` reads it;
:func:`uncertain` flags predictions whose top-2 margin is below twice it, where the
encrypted argmax may differ from the plaintext one.

These are measurements on those models, not a bound: a model with wider
calibrated ranges or smaller LayerNorm variances can amplify CKKS noise more.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from defenses.checks import check_int

MEASURED: dict[tuple[int, int], float] = {
    (1, 8): 1.4e-3,
    (1, 16): 7.4e-3,
    (2, 8): 1.5e-3,
    (2, 16): 1.1e-2,
    (3, 8): 1.9e-3,
    (3, 16): 2.6e-3,
}
"""(layers, width) -> largest |encrypted - plaintext| logit measured, rounded up.

Seed 0, 8 tokens, 2 heads, FFN 2 x width, 200 sequences a batch; the maximum over
the three kinds (random, wide, distilled; docs/crypto.md lists each)."""
CHAIN = "INTERACTIVE (N 8192, 5 levels of 30 bits)"
"""The CKKS parameters the table was measured on."""


def expected_logit_error(depth: int, width: int) -> float:
    r"""The encrypted logit error to expect at ``depth`` blocks and ``width``.

    The largest measured error over every measured size no larger than the
    smallest measured size that covers the request: with :math:`L^*` the smallest
    measured depth :math:`\ge` ``depth`` and :math:`w^*` the smallest measured
    width :math:`\ge` ``width``,

    .. math::

        E(\text{depth}, \text{width}) = \max\{e(L, w) : L \le L^*, w \le w^*\},

    non-decreasing in both arguments. Beyond the measured sizes it returns
    ``inf`` (not measured: every prediction is then uncertain).

    Raises
    ------
    ValueError
        If ``depth`` or ``width`` is not a positive int.
    """
    check_int("depth", depth, 1)
    check_int("width", width, 1)
    depths = sorted({n for n, _ in MEASURED if n >= depth})
    widths = sorted({w for _, w in MEASURED if w >= width})
    if not depths or not widths:
        return math.inf
    return max(e for (n, w), e in MEASURED.items() if n <= depths[0] and w <= widths[0])


def uncertain(logits: npt.ArrayLike, depth: int, width: int) -> npt.NDArray[np.bool_]:
    """Which rows' top-2 logit margin is at most twice the expected error.

    Two logits each off by up to :math:`E` can swap when their margin is below
    :math:`2E`; such a prediction's encrypted argmax may not be the plaintext
    model's.
    """
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] < 2:
        raise ValueError(f"logits: expected shape (n, classes >= 2), got {z.shape}")
    top = np.sort(z, axis=1)
    margin = top[:, -1] - top[:, -2]
    return np.asarray(margin <= 2.0 * expected_logit_error(depth, width))
