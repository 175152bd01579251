"""The array types every package annotates with.

One home for the aliases, so that a module says ``FloatArray`` and means the same
``numpy.typing.NDArray`` everywhere: float64 scores and features, int64 labels and
indices, boolean masks.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
