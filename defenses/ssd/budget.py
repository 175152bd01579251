r"""SSD's two per-row rules: the entropy that sizes the budget, and the temperature.

The L1 budget of a query with output :math:`f` is :math:`\varepsilon H(f)`, with
:math:`H(f) = -\sum_i f_i \ln f_i` in nats (:func:`entropy`); the pseudo-label is
drawn from :math:`\operatorname{softmax}(f / T)` with :math:`T` given or
:func:`default_temperature` of the number of classes. Neither imports torch: a
tensor's entropy uses the torch its caller has already imported.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, overload

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_int
from defenses.ssd.lazy import is_tensor, loaded_torch

if TYPE_CHECKING:
    import torch

__all__ = ["default_temperature", "entropy"]


def default_temperature(n_classes: int) -> float:
    r"""The temperature rule :math:`T_K = 0.9 / \ln(9 (K - 1))` (1.0 when K < 3).

    With probabilities in [0, 1], :math:`P(y = \text{top})` under
    :math:`\operatorname{softmax}(f/T)` depends on K; this rule reproduces the
    paper's :math:`T = 0.1` at K = 1000 and keeps the pseudo-label about as random at
    small K (0.15 at K = 50, 0.20 at K = 10, 0.25 at K = 5).
    """
    check_int("n_classes", n_classes, 1)
    if n_classes < 3:
        return 1.0
    return 0.9 / math.log(9.0 * (n_classes - 1))


@overload
def entropy(f: torch.Tensor) -> torch.Tensor: ...


@overload
def entropy(f: npt.ArrayLike) -> FloatArray: ...


def entropy(f: torch.Tensor | npt.ArrayLike) -> torch.Tensor | FloatArray:
    r"""Row entropy :math:`H(f) = -\sum_i f_i \ln f_i` in nats (:math:`0 \ln 0 = 0`).

    Each term is SciPy's ``entr``: :math:`-x \ln x` for :math:`x > 0`, 0 at
    :math:`x = 0`, :math:`-\infty` for :math:`x < 0`, NaN for NaN.
    """
    if is_tensor(f):
        torch_module = loaded_torch()
        assert torch_module is not None  # a tensor means torch is loaded
        value: torch.Tensor = torch_module.special.entr(f).sum(dim=-1)
        return value
    x = np.asarray(f, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.asarray(-x * np.log(x))
    terms[x == 0] = 0.0
    terms[x < 0] = -np.inf
    out: FloatArray = terms.sum(axis=-1)
    return out
