"""Token ids and attention masks for a converted model, checked."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch


def check_ids(
    ids: npt.ArrayLike, mask: npt.ArrayLike | None, n_tokens: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` and ``mask`` as (batch, n_tokens) tensors, or a clear error.

    A token id outside ``[0, vocab_size)`` is named as it is (the first one in
    row-major order, negative ids included), with its row and position.
    """
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"ids must be integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] != n_tokens:
        raise ValueError(
            f"ids: expected shape (batch >= 1, {n_tokens}) (the converted "
            f"length), got {arr.shape}"
        )
    outside = (arr < 0) | (arr >= vocab_size)
    if outside.any():
        row, col = (int(i) for i in np.argwhere(outside)[0])
        raise ValueError(
            f"ids: token id {int(arr[row, col])} (row {row}, position {col}) is "
            f"outside the embedding's vocabulary of {vocab_size} rows (ids 0 to "
            f"{vocab_size - 1}): the tokenizer does not match the model"
        )
    m = np.ones(arr.shape) if mask is None else np.asarray(mask, dtype=np.float64)
    if m.shape != arr.shape or not np.all((m == 0) | (m == 1)):
        raise ValueError(f"mask: expected 0/1 values of shape {arr.shape}")
    if not np.all(m[:, 0] == 1):
        raise ValueError("mask: the first ([CLS]) position must be attended")
    return torch.as_tensor(arr, dtype=torch.int64), torch.as_tensor(m)
